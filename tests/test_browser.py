"""Notebook 00 in a real JupyterLab page, driven by a real browser: what a reader sees, not what papermill sees.

JupyterLab runs from this environment on 127.0.0.1 (a free port, a random token) over a fresh copy of notebooks/
and scripts/ in a temporary folder, with the `parameters` cell set to SMOKE = True. Debian's headless Chromium,
driven by chromedriver through Selenium (both from /usr/bin, nothing downloaded), opens notebook 00, runs every cell
from the Run menu, saves it from the File menu, and the test checks the saved notebook and the page: no error
output, no traceback on the page, every widget rendered (the per-rank tabs included), the figure present. A
screenshot goes to outputs/browser/ for a person to look at.

Needs /usr/bin/chromium and /usr/bin/chromedriver (`apt-get install chromium chromium-driver`) and selenium (the
`test` extra). Without them the test skips, unless CI=true, where it fails. Deselect it with `-m "not browser"`.
"""
from __future__ import annotations

import contextlib
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
NOTEBOOK = "00_launching_workers.ipynb"
SCREENSHOT = OUTPUTS / "browser" / "00_launching_workers.png"
FAILED_SCREENSHOT = SCREENSHOT.with_name("00_launching_workers.failed.png")

# Generous on purpose: the machines this runs on are small and often busy.
SERVER_START_S = 180
PAGE_READY_S = 300
RUN_ALL_S = 15 * 60
WIDGETS_S = 180
SAVE_S = 120

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


def _copy_project(root: Path) -> Path:
    """notebooks/ and scripts/ side by side under root (notebook 00 runs ../scripts/, writes ../outputs/)."""
    shutil.copytree(NOTEBOOKS, root / "notebooks", ignore=shutil.ignore_patterns(".ipynb_checkpoints", "outputs"))
    shutil.copytree(SCRIPTS, root / "scripts", ignore=shutil.ignore_patterns("__pycache__"))
    path = root / "notebooks" / NOTEBOOK
    nb = json.loads(path.read_text())
    cell = next(c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", []))
    source = "".join(cell["source"])
    smoke, n = re.subn(r"^SMOKE\s*=.*$", "SMOKE = True  # set by tests/test_browser.py", source, flags=re.M)
    assert n == 1, f"{NOTEBOOK}'s parameters cell has no 'SMOKE = ...' line"
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
};
"""


SCROLLER_JS = ("const p = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');"
               "const n = p && (p.querySelector('.jp-WindowedPanel-outer') || p.querySelector('.jp-Notebook'));")


def _tracebacks(state: dict) -> list[str]:
    return [t[:2000] for t in state["stderr"] if IPYTHON_TRACEBACK.search(t)]


def _run_notebook_in_page(driver, base: str, token: str, saved: Path, code_cells: int):
    """Open, Run All Cells, Save, screenshot; returns (saved notebook, page after the run, page at the end)."""
    from selenium.webdriver.common.by import By

    driver.get(f"{base}/lab/tree/notebooks/{NOTEBOOK}?token={token}")
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

    # the window as tall as the notebook (at most 16000 px), scrolled to the top: one picture of every output
    height = driver.execute_script(SCROLLER_JS + "return n ? n.scrollHeight - n.clientHeight : 0;")
    size = driver.get_window_size()
    driver.set_window_size(size["width"], min(size["height"] + int(height) + 50, 16000))
    time.sleep(2)
    driver.execute_script(SCROLLER_JS + "if (n) n.scrollTop = 0;")
    time.sleep(1)
    assert driver.save_screenshot(str(SCREENSHOT)), "the screenshot was not written"
    print(f"screenshot: {SCREENSHOT}")
    return nb, after_run, state()


@pytest.mark.browser
@pytest.mark.timeout(RUN_ALL_S + 15 * 60)
def test_notebook_00_runs_in_jupyterlab(tmp_path: Path, monkeypatch):
    webdriver = _require_tools()
    root, work = tmp_path / "project", tmp_path / "work"
    root.mkdir()
    work.mkdir()
    saved = _copy_project(root)
    code_cells = sum(c["cell_type"] == "code" for c in json.loads(saved.read_text())["cells"])
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    FAILED_SCREENSHOT.unlink(missing_ok=True)

    with _jupyterlab(root, work) as (base, token), _chromium(webdriver, work, monkeypatch) as driver:
        try:
            nb, after_run, final = _run_notebook_in_page(driver, base, token, saved, code_cells)
        except BaseException:  # a failure or a timeout: what the page showed then, for a person to look at
            with contextlib.suppress(Exception):
                driver.save_screenshot(str(FAILED_SCREENSHOT))
                print(f"page at the failure: {FAILED_SCREENSHOT}")
                print(f"JupyterLab's log:\n{_log_tail(work / 'jupyterlab.log')}")
            raise

    errors = [(i, o.get("ename"), o.get("evalue")) for i, c in enumerate(nb["cells"])
              for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"error outputs in the saved notebook (cell, exception, message): {errors}"
    assert not _tracebacks(final), "the page shows a traceback"
    assert after_run["widgetErrors"] == 0 and final["widgetErrors"] == 0, "the page shows 'Error displaying widget'"
    assert final["loading"] == 0, "a widget is still 'Loading widget...'"
    assert final["tabs"] >= 1, "no per-rank output tabs (ipywidgets Tab) rendered in the outputs"
    assert final["images"] >= 1, "no matplotlib figure (PNG) rendered in the outputs"
    pngs = sum("image/png" in o.get("data", {}) for c in nb["cells"] for o in c.get("outputs", []))
    assert pngs >= 1, "the saved notebook holds no PNG figure"
