"""The site `./cookbook site` builds (tools/build_site.py), read in a real browser as a reader would, and its parts
held to what they promise.

The browser test takes the session's smoke run of notebook 09b (tests/notebooks/smoke_runs.py: papermill's, made by
this test or by test_notebooks.py, whichever asks first; it has a figure, per-rank widget tabs and describe_machine's
table), builds the site from that one executed copy, so the other notebooks must be listed as not yet executed, and
serves it on 127.0.0.1 (a free port). Debian's headless Chromium, through chromedriver and
Selenium as in test_browser.py, then opens the index and follows every link of every page: each internal one must
answer 200 and name a file (so it also opens from file://), each #fragment an element of its page. Every figure must
be decoded and drawn (not blank), nothing may come from another host, each notebook page must say the date, torch and
machine of its run, and the search box must find a word of notebook 00 that the index lacks. Its cost, measured on
the shared 2-core machine: the notebook 38 s and 12 s of CPU (none when test_notebooks.py ran it first), the build
20 to 30 s, the browser 10 s. (Notebook 00, its notebook before, cost 39 s of CPU more, run a second time: the
browser test runs 00 in JupyterLab.)

Without /usr/bin/chromium, /usr/bin/chromedriver or selenium it skips, unless CI=true, where it fails. The other
tests here need no browser and no kernel: they hold the parts, and one whole build (25 s), to executed notebooks
made by hand, a GPU run's among them.
"""
from __future__ import annotations

import contextlib
import json
import re
import shutil
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from helpers.paths import NOTEBOOKS, REPO_ROOT
from tools import build_site
from tools.build_site import EXECUTED_ID, Execution, Readme

BROWSED = "09b_debugging_distributed_jobs"
PAGE_S = 60  # one page loaded (local files; generous for a loaded machine)
SEARCH_S = 120  # the search worker indexes every page first


def _executed(cells: list[dict], **metadata) -> dict:
    return {"cells": [{"id": f"c{i}", "metadata": {}, **c} for i, c in enumerate(cells)],
            "metadata": metadata, "nbformat": 4, "nbformat_minor": 5}


def _machine_cell(facts: dict, capsys) -> dict:
    """The describe_machine cell of a notebook, with what describe_machine itself prints for `facts`."""
    import helpers.devices

    capsys.readouterr()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(helpers.devices, "machine_facts", lambda: facts)
        helpers.devices.describe_machine()
    printed = capsys.readouterr().out + "\nthis notebook launches 8 ranks\n"
    return {"cell_type": "code", "source": "facts = helpers.describe_machine()", "execution_count": 2,
            "outputs": [{"output_type": "stream", "name": "stdout", "text": printed}]}


GPU_FACTS = {"torch": "2.11.0+cu128", "python": "3.12.3", "platform": "Linux-5.15-x86_64", "cuda_build": "12.8",
             "gpus": 8, "gpu_names": ["NVIDIA H200"] * 8, "accelerator": "cuda", "cpu_capability": "AVX512",
             "cores": 16, "gloo": True, "nccl": True, "mpi": False, "default_backend": "nccl"}


def test_a_gpu_run_is_described_from_its_describe_machine_output(capsys, tmp_path):
    nb = _executed([{"cell_type": "markdown", "source": "# 05 · Title"}, _machine_cell(GPU_FACTS, capsys)],
                   papermill={"end_time": "2026-11-20T09:30:00.5+00:00", "duration": 412.0,
                              "parameters": {"SMOKE": False}, "exception": None})
    run = build_site.execution_of(nb, tmp_path / "x.ipynb")
    assert run.machine["torch"] == "2.11.0+cu128" and run.machine["gpus"] == "8"
    assert run.devices() == "8 x NVIDIA H200 (CUDA 12.8), 16 CPU cores (AVX512)"
    assert (run.finished, run.clock, run.smoke, run.errors) == ("2026-11-20 09:30 UTC", "papermill", False, False)
    box = build_site.executed_box(run)
    assert all(s in box for s in ("2026-11-20 09:30 UTC", "torch 2.11.0+cu128", "8 x NVIDIA H200", "full size"))


def test_a_budget_run_copy_is_found_and_dated_by_its_cells(tmp_path):
    """tools.budget_run (the GPU machine's runner) writes NAME.full.ipynb with nbclient: no papermill end time, the
    cells' timings instead, and error outputs in place (it runs every cell)."""
    timing = {"execution": {"shell.execute_reply": "2026-11-21T10:00:05.1Z"}}
    error = {"output_type": "error", "ename": "ZeroDivisionError", "evalue": "division by zero", "traceback": []}
    nb = _executed([{"cell_type": "code", "source": "1/0", "metadata": timing, "execution_count": 1,
                     "outputs": [error]}], papermill={"parameters": {"SMOKE": True}})
    (tmp_path / f"{BROWSED}.full.ipynb").write_text(json.dumps(nb))
    found = build_site.executed_copy(tmp_path, BROWSED)
    assert found == tmp_path / f"{BROWSED}.full.ipynb"
    run = build_site.execution_of(nb, found)
    assert (run.finished, run.clock, run.smoke, run.errors) == ("2026-11-21 10:00 UTC", "cell timings", True, True)
    assert run.devices() == "a machine not recorded" and run.torch() == "torch not recorded"


def test_a_page_drops_widget_views_keeps_outputs_and_points_links_at_pages():
    tab = {"output_type": "display_data", "metadata": {},
           "data": {build_site.WIDGET_VIEW: {"model_id": "a"}, "text/plain": "Tab(children=...)"}}
    text = {"output_type": "stream", "name": "stdout", "text": "[rank0] hello\n"}
    nb = _executed([{"cell_type": "markdown", "source": "# 00 · Title"},
                    {"cell_type": "markdown", "source": "See [01](01_x.ipynb), [11](11_y.ipynb#an-item)."},
                    {"cell_type": "code", "source": "launch()", "execution_count": 1, "outputs": [tab, text]},
                    {"cell_type": "code", "source": "explore()", "execution_count": 2, "outputs": [tab]}],
                   widgets={"application/vnd.jupyter.widget-state+json": {"state": {}}})
    run = Execution("2026-11-28 18:16 UTC", "papermill", 49.0, True, False, {"torch": "2.13.0+cpu", "cores": "2"})
    page = build_site.site_notebook(nb, run, executed={"00_title", "11_y"})
    assert "widgets" not in page["metadata"] and "widgets" in nb["metadata"], "the executed copy is left as it was"
    assert page["cells"][1]["source"].startswith(f'<div class="admonition info" id="{EXECUTED_ID}">')
    assert page["cells"][2]["source"] == "See [01](index.html), [11](11_y.html#an-item)."
    assert page["cells"][3]["outputs"] == [text]
    assert page["cells"][4]["outputs"][0]["data"] == {"text/markdown": build_site.WIDGET_NOTE}


def test_the_index_is_the_readmes_table_with_every_notebook_executed_or_not():
    readme = Readme.parse((REPO_ROOT / "README.md").read_text())
    names = [p.stem for p in NOTEBOOKS.glob("[0-9]*.ipynb")]
    run = Execution("2026-11-28 18:16 UTC", "papermill", 49.0, True, False, {"torch": "2.13.0+cpu", "cores": "2"})
    index = build_site.index_markdown(readme, {BROWSED: run}, names)
    rows = [line for line in index.splitlines() if line.startswith("| ") and "`" in line.split("|")[1]]
    assert sorted(re.search(r"`(\w+)`", r.split("|")[1]).group(1) for r in rows) == sorted(names)
    executed = [r for r in rows if f"`{BROWSED}`" in r]
    assert executed == [r for r in rows if "not yet executed" not in r]
    assert f"]({BROWSED}.ipynb)" in executed[0] and "torch 2.13.0+cpu" in executed[0]
    words = next(row[1] for row in readme.rows if row[0] == f"`{BROWSED}`")
    assert words in executed[0], "the README's own words for the notebook"


def _png() -> str:
    import base64
    import io

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 1))
    ax.plot([0, 1], [1, 0])
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode()


def test_a_built_page_keeps_its_outputs_loads_nothing_from_elsewhere_and_its_anchors_land(tmp_path, capsys):
    """A whole build (mkdocs, no browser) from one executed notebook made by hand: a GPU run, a heading with code
    (whose table-of-contents link once missed its anchor), a fenced block, a figure and a widget view."""
    name = "01_process_groups_and_collectives"
    view = {"output_type": "display_data", "metadata": {}, "data": {build_site.WIDGET_VIEW: {"model_id": "m"},
                                                                   "text/plain": "interactive(...)"}}
    figure = {"output_type": "display_data", "metadata": {}, "data": {"image/png": _png(), "text/plain": "<Figure>"}}
    nb = _executed([{"cell_type": "markdown", "source": "# 01 · Process groups"},
                    _machine_cell(GPU_FACTS, capsys),
                    {"cell_type": "markdown", "source": "## Measure it: what `TORCH_DISTRIBUTED_DEBUG=DETAIL` costs\n\n"
                                                        "```bash\n# keep `this` as typed\n```\n"
                                                        "See [00](00_launching_workers.ipynb#a-first-all_reduce), "
                                                        "[the recipe](../scripts/train/README.md)."},
                    {"cell_type": "code", "source": "plot()", "execution_count": 3, "outputs": [figure]},
                    {"cell_type": "code", "source": "explore()", "execution_count": 4, "outputs": [view]}],
                   papermill={"end_time": "2026-11-20T09:30:00+00:00", "duration": 61.0,
                              "parameters": {"SMOKE": True}, "exception": None},
                   widgets={"application/vnd.jupyter.widget-state+json": {"state": {}, "version_major": 2}})
    (tmp_path / "executed").mkdir()
    (tmp_path / "executed" / f"{name}.ipynb").write_text(json.dumps(nb))
    before = {p: p.stat().st_mtime_ns for p in NOTEBOOKS.rglob("*")}

    runs = build_site.build_site(tmp_path / "executed", tmp_path / "site")

    assert set(runs) == {name} and {p: p.stat().st_mtime_ns for p in NOTEBOOKS.rglob("*")} == before
    page = (tmp_path / "site" / f"{name}.html").read_text()
    index = (tmp_path / "site" / "index.html").read_text()
    assert index.count("not yet executed") == len(list(NOTEBOOKS.glob("[0-9]*.ipynb"))) - 1
    assert f'href="{name}.html"' in index and "8 x NVIDIA H200" in index
    ids = set(re.findall(r'\bid="([^"]+)"', page))
    assert [h for h in re.findall(r'href="#([^"]+)"', page) if h not in ids] == []
    assert "measure-it-what-torch_distributed_debugdetail-costs" in ids
    assert "`this` as typed" in page, "a fenced block is shown as written"
    assert 'href="index.html"' in page, "the link to notebook 00, not executed here, goes to the index"
    assert page.count('src="data:image/png;base64,') == 1 and build_site.WIDGET_NOTE.split(" (")[0] in page
    assert all(s in page for s in ("2026-11-20 09:30 UTC", "torch 2.11.0+cu128", "8 x NVIDIA H200", "smoke mode"))
    loads = re.findall(r'<(?:script|img|iframe)\b[^>]*\bsrc="([^"]*)"|<link\b[^>]*\bhref="([^"]*)"', page + index)
    assert [u for pair in loads for u in pair if re.match(r"(https?:)?//", u)] == [], "a page loads from elsewhere"
    assert build_site.broken_links(tmp_path / "site") == [f"{name}.html -> ../scripts/train/README.md"]


@pytest.mark.parametrize("out", ["notebooks/site", "outputs", "."])
def test_the_site_is_never_built_over_the_notebooks_or_the_executed_copies(out, capsys):
    with pytest.raises(SystemExit) as stop:
        build_site.main(["--executed", str(REPO_ROOT / "outputs"), "--out", str(REPO_ROOT / out)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "may not be built into" in err


# Everything a page loads (scripts, styles, images, frames) and every link on it, with what the page drew.
PAGE_JS = """
const loads = [...document.querySelectorAll('script[src], link[href]:not([rel~="canonical"]), img[src], iframe[src]')]
  .map(e => e.src || e.href);
const fetched = performance.getEntriesByType('resource').map(e => e.name);
const images = [...document.querySelectorAll('img')].map(img => ({src: img.src.slice(0, 40), ink: ink(img)}));
const svgs = [...document.querySelectorAll('.jp-RenderedSVG svg')].map(s => s.getBoundingClientRect().width);
return {
  links: [...document.querySelectorAll('a[href]')].map(a => a.href),
  ids: [...document.querySelectorAll('[id]')].map(e => e.id),
  loads: loads.concat(fetched),
  images: images,
  svgs: svgs,
  executed: (document.getElementById(arguments[0]) || {}).textContent || null,
  title: document.title,
};
"""


@contextlib.contextmanager
def _served(site: Path):
    server = build_site.serve(site)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(30)


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _search_word(executed: dict, index_html: str) -> str:
    """The most frequent plain word of the notebook's Markdown that the index page does not contain."""
    words = re.findall(r"\b[a-z]{8,}\b", " ".join("".join(c["source"]) for c in executed["cells"]
                                                  if c["cell_type"] == "markdown"))
    absent = [w for w in words if w not in index_html.lower()]
    assert absent, "every word of the notebook is on the index too: no word tells the search worked"
    return max(sorted(set(absent)), key=absent.count)


def _read_every_page(driver, base: str, site: Path, ink_js: str) -> dict[str, dict]:
    """Open the index, then every page an internal link names; checks each link as it goes. Returns each page's
    state (PAGE_JS) by its path."""
    from selenium.webdriver.support.ui import WebDriverWait

    pages, queue, fragments, statuses = {}, ["index.html"], [], {}
    while queue:
        path = queue.pop(0)
        if path in pages:
            continue
        driver.get(base + path)
        WebDriverWait(driver, PAGE_S).until(lambda d: d.execute_script("return document.readyState") == "complete")
        state = driver.execute_script(ink_js + PAGE_JS, EXECUTED_ID)
        pages[path] = state
        foreign = [u for u in state["loads"] if not u.startswith((base, "data:"))]
        assert not foreign, f"{path} loads from elsewhere: {foreign}"
        for link in state["links"]:
            if not link.startswith(base):
                continue  # another host: not this site's to serve (the theme's credit)
            target = urllib.parse.urlsplit(link[len(base):])
            if target.path not in statuses:
                statuses[target.path] = _status(base + target.path)
                assert statuses[target.path] == 200, f"{path} links to {link}: HTTP {statuses[target.path]}"
                assert (site / target.path).is_file(), f"{path} links to {link}, which is no file (file:// breaks)"
            if target.path.endswith(".html"):
                queue.append(target.path)
                if target.fragment:
                    fragments.append((path, target.path, urllib.parse.unquote(target.fragment)))
    missing = [f"{src} -> {dst}#{frag}" for src, dst, frag in fragments if frag not in pages[dst]["ids"]]
    assert not missing, f"links to an anchor their page lacks: {missing}"
    return pages


def _search(driver, base: str, word: str) -> list[str]:
    """Type `word` into the search box of the index; the links of the results once there are some."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(base + "index.html")
    WebDriverWait(driver, PAGE_S).until(lambda d: d.execute_script("return document.readyState") == "complete")
    box = driver.find_element(By.CSS_SELECTOR, "input.md-search__input")
    box.click()
    box.send_keys(word)
    found = lambda d: [a.get_attribute("href") for a in d.find_elements(By.CSS_SELECTOR,  # noqa: E731
                                                                         ".md-search-result__item a")]
    return WebDriverWait(driver, SEARCH_S).until(found)


@pytest.mark.browser
@pytest.mark.timeout(60 * 60)  # 5 min at a load of 16 (the docstring): ten times that and more
def test_the_site_reads_in_a_browser(tmp_path: Path, monkeypatch, smoke_runs, request):
    from test_browser import DRAWN_INK, INK_JS, _chromium, _require_tools

    webdriver = _require_tools()
    started = time.monotonic()
    run, _ = smoke_runs.executed(NOTEBOOKS / f"{BROWSED}.ipynb", request.node.nodeid)
    (tmp_path / "executed").mkdir()
    executed_path = Path(shutil.copy(run, tmp_path / "executed" / run.name))
    executed = json.loads(executed_path.read_text())
    ran = time.monotonic()
    site = tmp_path / "site"
    runs = build_site.build_site(tmp_path / "executed", site)
    built = time.monotonic()
    assert set(runs) == {BROWSED}
    names = [p.stem for p in NOTEBOOKS.glob("[0-9]*.ipynb")]
    index_html = (site / "index.html").read_text()
    assert index_html.count("not yet executed") == len(names) - 1

    (tmp_path / "work").mkdir()
    with _served(site) as base, _chromium(webdriver, tmp_path / "work", monkeypatch) as driver:
        pages = _read_every_page(driver, base, site, INK_JS)
        results = _search(driver, base, word := _search_word(executed, index_html))
    print(f"notebook {ran - started:.0f} s, build {built - ran:.0f} s, browser {time.monotonic() - built:.0f} s; "
          f"pages read: {sorted(pages)}; searched for {word!r}: {results[:3]}")

    assert f"{BROWSED}.html" in pages, "the index links to the executed notebook's page"
    page = pages[f"{BROWSED}.html"]
    pngs = sum("image/png" in o.get("data", {}) for c in executed["cells"] for o in c.get("outputs", []))
    drawn = [i for i in page["images"] if i["ink"] >= DRAWN_INK]
    assert pngs >= 1 and len(drawn) >= pngs, f"{pngs} figures executed, drawn on the page: {page['images']}"
    for path, state in pages.items():
        blank = [i for i in state["images"] if i["ink"] < DRAWN_INK]
        assert not blank, f"{path}: images not decoded or drawn blank: {blank}"
        assert all(w > 0 for w in state["svgs"]), f"{path}: an SVG figure drawn with no width"
    facts = build_site.machine_of(executed)
    end = executed["metadata"]["papermill"]["end_time"][:10]
    assert facts["torch"] and all(s in (page["executed"] or "") for s in (end, f"torch {facts['torch']}",
                                                                             f"{facts['cores']} CPU cores")), \
        f"the page's executed box: {page['executed']!r}"
    assert any(urllib.parse.urlsplit(r).path == f"/{BROWSED}.html" for r in results), \
        f"search for {word!r} found {results}"
