"""Notebooks in a real JupyterLab page, driven by a real browser: what a reader sees, not what papermill sees.

JupyterLab runs from this environment on 127.0.0.1 (a free port, a random token) over a fresh copy of notebooks/
and scripts/ in a temporary folder, with the notebook's `parameters` cell set to SMOKE = True. Debian's headless
Chromium, driven by chromedriver through Selenium (both from /usr/bin, nothing downloaded), opens the notebook, runs
every cell from the Run menu, saves it from the File menu, and the test checks the saved notebook and the page: no
error output, no traceback on the page, every widget rendered, the figures present. Each notebook has its own
server and browser, stopped with everything they started. Notebook 00 shows per-rank output tabs; notebook 08 an
explorer (helpers.explore), whose controls the test sets to values other than the defaults before pressing its Run
button, and whose output must then appear: the one thing papermill cannot check; notebook 10's planner explorer
the same way. A screenshot of each notebook goes to outputs/browser/ for a person to look at.

Needs /usr/bin/chromium and /usr/bin/chromedriver (`apt-get install chromium chromium-driver`) and selenium (the
`test` extra). Without them the test skips, unless CI=true, where it fails. Deselect it with `-m "not browser"`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from helpers.launcher.sessions import stop_sessions
from helpers.paths import NOTEBOOKS, OUTPUTS, REPO_ROOT, SCRIPTS

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
SCREENSHOTS = OUTPUTS / "browser"


@dataclasses.dataclass(frozen=True)
class Page:
    """What a notebook must show in the page once all its cells have run in smoke mode."""

    notebook: str
    figures: int  # matplotlib PNGs, at least (on the page and in the saved notebook)
    tabs: int = 0  # per-rank output tabs (ipywidgets Tab), at least
    explore: tuple[tuple[str, str], ...] = ()  # an explorer's (control, option to pick) for one press of Run
    explored: tuple[str, ...] = ()  # text the press's output must show (beside a figure)

    @property
    def screenshot(self) -> Path:
        return SCREENSHOTS / self.notebook.replace(".ipynb", ".png")


PAGES = [
    Page("00_launching_workers.ipynb", figures=1, tabs=1),
    # the bubble sweep and the explorer's default step; a press with GPipe at m = 8 (defaults: 1F1B, m = 4)
    Page("08_pipeline_parallel.ipynb", figures=2, explore=(("n_microbatches", "8"), ("schedule", "gpipe")),
         explored=("gpipe, p = ", ", v = 1, m = 8: step ")),
    # the planner's runs against the recipe and the default plan; a press for a 40 GB device with full
    # checkpointing (defaults: 80 GB, none), whose plan, command and list of fitting layouts must show
    Page("10_parallelism_planner.ipynb", figures=2, explore=(("memory_gb", "40"), ("ac", "full")),
         explored=("checkpointing full", "GB against 40 GB", "layouts of 8 GPUs of 40 GB fit", "$ torchrun")),
]

# Generous on purpose: the machines this runs on are small and often busy. Each is ten times or more what its step took
# on the 2-core machine at a load of 10 to 20: JupyterLab answering 17 s, the page ready 24 s, Run All 130 s (10), the
# widgets and the save 1 s, the explorer's press 10 s.
SERVER_START_S = 300
PAGE_READY_S = 300
RUN_ALL_S = 30 * 60
WIDGETS_S = 180
SAVE_S = 120
EXPLORE_S = 300

CHROMIUM_FLAGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
    # a closed network: without these Chromium keeps trying to reach Google's services
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
    "--disable-quic", "--disable-breakpad", "--disable-crash-reporter", "--disable-extensions",
    "--no-default-browser-check", "--window-size=1500,1100",
]

# What IPython writes at the top of an uncaught exception's traceback (an error output), e.g.
# "-----...\nValueError    Traceback (most recent call last)\nCell In[3], line 1". A worker's own traceback
# printed on stderr (which notebook 00 shows on purpose) starts with "Traceback" alone.
IPYTHON_TRACEBACK = re.compile(r"-{20,}\s*\n\s*\w[\w.]*\s+Traceback \(most recent call last\)")

# JupyterLab settings for this test only (a fresh settings folder): every cell attached to the page so that every
# prompt and output can be read, no blank space after the last cell (the screenshot is as tall as the notebook),
# and nothing that would reach for the network or pop up a question.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none", "scrollPastEnd": False},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                        "checkForUpdates": False},
    "@jupyterlab/extensionmanager-extension/plugin.jupyterlab-settings": {"enabled": False},
}


def _require_tools():
    """The webdriver module, or a skip (a failure with CI=true) saying what is missing."""
    missing = [f"{p} (apt-get install {pkg})" for p, pkg in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver"))
               if not (p.is_file() and os.access(p, os.X_OK))]
    try:
        from selenium import webdriver
    except ImportError:
        webdriver = None
        missing.append("the selenium package (pip install -e '.[test]')")
    if missing:
        reason = "browser test needs " + ", ".join(missing)
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail(reason + " (CI=true: not skipped)")
        pytest.skip(reason)
    return webdriver


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _copy_project(root: Path, notebook: str) -> Path:
    """notebooks/ and scripts/ side by side under root (notebooks run ../scripts/, write ../outputs/); `notebook`
    in smoke mode."""
    shutil.copytree(NOTEBOOKS, root / "notebooks", ignore=shutil.ignore_patterns(".ipynb_checkpoints", "outputs"))
    shutil.copytree(SCRIPTS, root / "scripts", ignore=shutil.ignore_patterns("__pycache__"))
    path = root / "notebooks" / notebook
    nb = json.loads(path.read_text())
    cell = next(c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", []))
    source = "".join(cell["source"])
    smoke, n = re.subn(r"^SMOKE\s*=.*$", "SMOKE = True  # set by tests/notebooks/test_browser.py", source, flags=re.M)
    assert n == 1, f"{notebook}'s parameters cell has no 'SMOKE = ...' line"
    cell["source"] = smoke.splitlines(keepends=True)
    path.write_text(json.dumps(nb, indent=1) + "\n")
    return path


def _log_tail(log: Path, chars: int = 4000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


@contextlib.contextmanager
def _jupyterlab(root: Path, work: Path):
    """A JupyterLab server on 127.0.0.1 serving root; yields (base URL, token). Stopped with all it started."""
    port, token = _free_port(), secrets.token_hex(24)
    settings = work / "lab-settings"
    for name, values in LAB_SETTINGS.items():
        (settings / name).parent.mkdir(parents=True, exist_ok=True)
        (settings / name).write_text(json.dumps(values))
    env = dict(os.environ)
    env.update(
        JUPYTER_CONFIG_DIR=str(work / "jupyter-config"),  # no user config; the environment's own still applies
        JUPYTER_RUNTIME_DIR=str(work / "jupyter-runtime"),
        JUPYTERLAB_SETTINGS_DIR=str(settings),
        JUPYTERLAB_WORKSPACES_DIR=str(work / "lab-workspaces"),
        # the kernel imports helpers from this checkout even where it is not installed
        PYTHONPATH=os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
    )
    env.pop("PYTEST_CURRENT_TEST", None)
    log = work / "jupyterlab.log"
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={root}", "--ServerApp.open_browser=False"]
    if os.geteuid() == 0:  # CI containers run as root; JupyterLab refuses that unless told
        cmd.append("--allow-root")
    with open(log, "wb") as out:
        server = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            assert server.poll() is None, f"JupyterLab exited with {server.returncode}:\n{_log_tail(log)}"
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=10) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            assert time.monotonic() < deadline, f"JupyterLab not answering after {SERVER_START_S} s:\n{_log_tail(log)}"
            time.sleep(1)
        yield base, token
    finally:
        _stop_server(server, base, token)


def _stop_server(server: subprocess.Popen, base: str, token: str) -> None:
    """Ask the server to shut down (it stops its kernels), then stop whatever is left of the tree it had.

    The tree is taken first: kernels lead sessions of their own, a kernel's fork-server and workers lead theirs,
    and once their parent has gone they are no longer below it."""
    try:
        tree = psutil.Process(server.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    handles = {p.pid: p for p in tree}
    try:
        request = urllib.request.Request(f"{base}/api/shutdown?token={token}", method="POST", data=b"")
        urllib.request.urlopen(request, timeout=30).close()
        server.wait(60)
    except Exception:  # noqa: BLE001 - not answering or slow: the signals below do it
        pass

    def is_gone(pid: int, timeout: float) -> bool:
        if pid == server.pid:
            try:
                server.wait(timeout)
                return True
            except subprocess.TimeoutExpired:
                return False
        proc, deadline = handles[pid], time.monotonic() + timeout
        while True:
            try:
                if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
                    return True
            except psutil.NoSuchProcess:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    stop_sessions([server.pid, *handles], is_gone, grace=5.0)


@contextlib.contextmanager
def _chromium(webdriver, work: Path, monkeypatch):
    """Headless Debian Chromium under /usr/bin/chromedriver; quit with every process it started."""
    from selenium.webdriver.chrome.service import Service

    monkeypatch.setenv("SE_OFFLINE", "true")  # Selenium Manager must never download a browser or a driver
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS + [f"--user-data-dir={work / 'chromium-profile'}"]:
        options.add_argument(flag)
    service = Service(executable_path=str(CHROMEDRIVER), log_output=str(work / "chromedriver.log"))
    driver = webdriver.Chrome(service=service, options=options)
    try:
        yield driver
    finally:
        tree = []
        with contextlib.suppress(Exception):
            tree = psutil.Process(service.process.pid).children(recursive=True)
        with contextlib.suppress(Exception):
            driver.quit()
        gone, alive = psutil.wait_procs(tree, timeout=10)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(alive, timeout=5)


def _wait(what: str, seconds: float, check, interval: float = 1.0):
    """check() until it returns something true; fails after `seconds` saying what it waited for."""
    deadline = time.monotonic() + seconds
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {seconds:.0f} s waiting for {what}")
        time.sleep(interval)


def _click_menu(driver, menu: str, label: str, commands: tuple[str, ...]) -> None:
    """Open the main menu bar's `menu` and click its item `label` (one of `commands`), as a person would.

    The Run menu's "Run All Cells" is runmenu:run-all, which runs notebook:run-all-cells for a notebook."""
    from selenium.webdriver.common.by import By

    def menu_item():
        items = [e for e in driver.find_elements(By.CSS_SELECTOR, ".lm-MenuBar li.lm-MenuBar-item")
                 if e.text.strip() == menu]
        return items[0] if items else None

    _wait(f"the {menu} menu", 60, menu_item).click()
    selector = ", ".join(f'.lm-Menu li.lm-Menu-item[data-command="{c}"]' for c in commands)

    def enabled_item():
        found = [e for e in driver.find_elements(By.CSS_SELECTOR, selector)
                 if e.text.strip().startswith(label) and "lm-mod-disabled" not in (e.get_attribute("class") or "")]
        return found[0] if found else None

    _wait(f"{menu} → {label} ({' or '.join(commands)}) enabled", 60, enabled_item).click()


# One round trip reads the state of the page.
PAGE_STATE_JS = r"""
const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
if (!panel) return null;
const prompts = [...panel.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')].map(e => e.textContent.trim());
const indicator = panel.querySelector('.jp-Notebook-ExecutionIndicator');
// the status bar's "Python 3 (ipykernel) | Idle": the toolbar's indicator says idle before the kernel is connected
const kernelText = [...document.querySelectorAll('.jp-StatusBar-TextItem')].map(e => e.textContent.trim())
  .find(t => /\|\s*\w+$/.test(t) && /kernel/i.test(t));
const stderr = [...panel.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
  .map(e => e.textContent);
const text = [...panel.querySelectorAll('.jp-OutputArea')].map(e => e.textContent).join('\n');
return {
  prompts: prompts,
  status: indicator ? indicator.getAttribute('data-status') : null,
  kernel: kernelText ? kernelText.split('|').pop().trim() : null,
  stderr: stderr,
  loading: (text.match(/Loading widget\.\.\./g) || []).length,
  widgetErrors: (text.match(/Error displaying widget/g) || []).length,
  tabs: panel.querySelectorAll('.jp-OutputArea .jupyter-widgets.widget-tab, .jp-OutputArea .widget-tab').length,
  images: panel.querySelectorAll('.jp-OutputArea img[src^="data:image/png"]').length,
  runButtons: [...panel.querySelectorAll('.jp-OutputArea .widget-interact button')]
    .filter(b => b.textContent.trim() === 'Run').length,
};
"""


SCROLLER_JS = ("const p = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');"
               "const n = p && (p.querySelector('.jp-WindowedPanel-outer') || p.querySelector('.jp-Notebook'));")


def _tracebacks(state: dict) -> list[str]:
    return [t[:2000] for t in state["stderr"] if IPYTHON_TRACEBACK.search(t)]


def _run_notebook_in_page(driver, base: str, token: str, saved: Path, code_cells: int, page: Page):
    """Open, Run All Cells, Save, press the explorer's Run if `page` says so, screenshot; returns (saved notebook,
    page after the run, page at the end, the explorer's output text or None)."""
    from selenium.webdriver.common.by import By

    driver.get(f"{base}/lab/tree/notebooks/{page.notebook}?token={token}")
    state = lambda: driver.execute_script(PAGE_STATE_JS)  # noqa: E731

    def ready():
        s = state()
        idle = s and s["status"] == "idle" and s["kernel"] == "Idle"
        return s if idle and len(s["prompts"]) == code_cells else None

    _wait("the notebook open with an idle kernel", PAGE_READY_S, ready)
    # the file browser folded away, so the notebook has the page's width (and the screenshot shows it)
    for tab in driver.find_elements(By.CSS_SELECTOR, ".jp-SideBar.jp-mod-left li.lm-TabBar-tab.lm-mod-current"):
        tab.click()
    driver.find_element(By.CSS_SELECTOR, ".jp-NotebookPanel .jp-Notebook").click()

    started = time.monotonic()
    _click_menu(driver, "Run", "Run All Cells", ("runmenu:run-all", "notebook:run-all-cells"))

    def finished():
        s = state()
        found = _tracebacks(s)
        assert not found, "a cell raised; the page shows:\n" + "\n---\n".join(found)
        done = (all(re.fullmatch(r"\[\d+\]:", p) for p in s["prompts"]) and s["status"] == "idle"
                and s["kernel"] == "Idle")
        return s if done else None

    _wait(f"all {code_cells} code cells run and the kernel idle", RUN_ALL_S, finished, interval=2.0)
    print(f"run all cells: {time.monotonic() - started:.0f} s")
    after_run = _wait("every widget rendered (none left 'Loading widget...')", WIDGETS_S,
                      lambda: (s := state())["loading"] == 0 and s)

    _click_menu(driver, "File", "Save", ("docmanager:save",))

    def saved_nb():
        nb = json.loads(saved.read_text())
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        return nb if all(c.get("execution_count") for c in code) else None

    nb = _wait("the saved notebook with every cell's execution count", SAVE_S, saved_nb)
    dirty = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-mod-dirty, .lm-DockPanel-tabBar .jp-mod-dirty"
    _wait("the page to show it saved", SAVE_S, lambda: not driver.find_elements(By.CSS_SELECTOR, dirty))

    explored = _press_explorer(driver, page, state) if page.explore else None

    # the window as tall as the notebook (at most 16000 px), scrolled to the top: one picture of every output
    height = driver.execute_script(SCROLLER_JS + "return n ? n.scrollHeight - n.clientHeight : 0;")
    size = driver.get_window_size()
    driver.set_window_size(size["width"], min(size["height"] + int(height) + 50, 16000))
    time.sleep(2)
    driver.execute_script(SCROLLER_JS + "if (n) n.scrollTop = 0;")
    time.sleep(1)
    assert driver.save_screenshot(str(page.screenshot)), "the screenshot was not written"
    print(f"screenshot: {page.screenshot}")
    return nb, after_run, {**state(), "ink": driver.execute_script(FIGURES_JS)}, explored


# The share of a PNG's pixels in dark ink (text, spines, ticks: matplotlib draws them black), once decoded. A whole
# figure of this cookbook has about 2 %; the blank or half-drawn images an explorer once showed had 0 to 0.1 %.
INK_JS = r"""
const ink = img => {
  if (!img.complete || !img.naturalWidth) return 0;
  const c = document.createElement('canvas');
  c.width = img.naturalWidth; c.height = img.naturalHeight;
  const g = c.getContext('2d');
  g.drawImage(img, 0, 0);
  const d = g.getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 0; i < d.length; i += 4) if (d[i] < 80 && d[i + 1] < 80 && d[i + 2] < 80 && d[i + 3] > 128) n++;
  return n / (c.width * c.height);
};
"""
DRAWN_INK = 0.005

# Every figure on the page, as its share of dark ink.
FIGURES_JS = INK_JS + r"""
const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
return [...panel.querySelectorAll('.jp-OutputArea img[src^="data:image/png"]')].map(ink);
"""

# The explorer's output (ipywidgets `interactive` in manual mode: controls, a Run button, an Output widget).
EXPLORER_OUTPUT_JS = INK_JS + r"""
const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea .widget-interact');
const out = panel && panel.querySelector('.widget-output');
return out ? {text: out.textContent, ink: [...out.querySelectorAll('img[src^="data:image/png"]')].map(ink)} : null;
"""


def _press_explorer(driver, page: Page, state) -> str:
    """Set the explorer's dropdowns to `page.explore`'s options, press Run, wait for its output and an idle kernel;
    returns the output's text."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    panels = driver.find_elements(By.CSS_SELECTOR, ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea "
                                                   ".widget-interact")
    assert len(panels) == 1, f"{page.notebook}: expected one explorer on the page, found {len(panels)}"
    panel = panels[0]
    dropdowns = {box.find_element(By.CSS_SELECTOR, "label").text.strip(): box.find_element(By.TAG_NAME, "select")
                 for box in panel.find_elements(By.CSS_SELECTOR, ".widget-dropdown")}
    for name, option in page.explore:
        assert name in dropdowns, f"no control {name!r} in the explorer; it has {sorted(dropdowns)}"
        select = Select(dropdowns[name])
        assert select.first_selected_option.text.strip() != option, f"{name} already shows {option}: not a change"
        select.select_by_visible_text(option)
        assert select.first_selected_option.text.strip() == option
    buttons = [b for b in panel.find_elements(By.TAG_NAME, "button") if b.text.strip() == "Run"]
    assert len(buttons) == 1, f"expected the explorer's one Run button, found {len(buttons)}"
    started = time.monotonic()
    buttons[0].click()

    def shown():
        out = driver.execute_script(EXPLORER_OUTPUT_JS)
        assert not (out and IPYTHON_TRACEBACK.search(out["text"])), "the press raised:\n" + out["text"][-3000:]
        s = state()
        done = (out and all(t in out["text"] for t in page.explored) and any(i >= DRAWN_INK for i in out["ink"])
                and s["kernel"] == "Idle")
        return out if done else None

    out = _wait(f"the explorer's output after Run ({', '.join(page.explored)} and a figure drawn whole)",
                EXPLORE_S, shown, 2.0)
    print(f"explorer press: {time.monotonic() - started:.0f} s; it printed: {out['text'].strip()[:300]}")
    driver.execute_script("arguments[0].scrollIntoView();", panel)
    time.sleep(1)
    shot = page.screenshot.with_suffix(".explorer.png")
    assert panel.screenshot(str(shot)), "the explorer's screenshot was not written"
    print(f"explorer screenshot: {shot}")
    return out["text"]


@pytest.mark.browser
@pytest.mark.timeout(RUN_ALL_S + 15 * 60)
@pytest.mark.parametrize("page", PAGES, ids=[p.notebook.split("_")[0] for p in PAGES])
def test_notebook_runs_in_jupyterlab(page: Page, tmp_path: Path, monkeypatch):
    webdriver = _require_tools()
    root, work = tmp_path / "project", tmp_path / "work"
    root.mkdir()
    work.mkdir()
    saved = _copy_project(root, page.notebook)
    code_cells = sum(c["cell_type"] == "code" for c in json.loads(saved.read_text())["cells"])
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    failed_screenshot = page.screenshot.with_suffix(".failed.png")
    failed_screenshot.unlink(missing_ok=True)

    with _jupyterlab(root, work) as (base, token), _chromium(webdriver, work, monkeypatch) as driver:
        try:
            nb, after_run, final, explored = _run_notebook_in_page(driver, base, token, saved, code_cells, page)
        except BaseException:  # a failure or a timeout: what the page showed then, for a person to look at
            with contextlib.suppress(Exception):
                driver.save_screenshot(str(failed_screenshot))
                print(f"page at the failure: {failed_screenshot}")
                print(f"JupyterLab's log:\n{_log_tail(work / 'jupyterlab.log')}")
            raise

    errors = [(i, o.get("ename"), o.get("evalue")) for i, c in enumerate(nb["cells"])
              for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"error outputs in the saved notebook (cell, exception, message): {errors}"
    assert not _tracebacks(final), "the page shows a traceback"
    assert after_run["widgetErrors"] == 0 and final["widgetErrors"] == 0, "the page shows 'Error displaying widget'"
    assert final["loading"] == 0, "a widget is still 'Loading widget...'"
    assert final["tabs"] >= page.tabs, f"{final['tabs']} per-rank output tabs rendered, expected {page.tabs}"
    assert final["images"] >= page.figures, f"{final['images']} matplotlib figures on the page, expected {page.figures}"
    blank = [round(i, 4) for i in final["ink"] if i < DRAWN_INK]
    assert not blank, f"figures on the page drawn blank or in part (share of dark ink {blank}; whole: about 0.02)"
    pngs = sum("image/png" in o.get("data", {}) for c in nb["cells"] for o in c.get("outputs", []))
    assert pngs >= page.figures, f"the saved notebook holds {pngs} PNG figures, expected {page.figures}"
    if page.explore:
        assert after_run["runButtons"] == 1, "the explorer's Run button is not on the page"
        assert all(t in explored for t in page.explored)
