"""No test may leave a process behind, nor anything a worker started (`processes_left` also finds what escaped the
tree); launcher tests also must leave signal handlers and environment as they were.

The launcher's fork-server is the one process allowed to outlive a test (it is started once and reused, as in a
kernel); its workers are not. It is started before the first test, so no launch's timing includes its start, and
stopped after the last one."""
from __future__ import annotations

import os
import signal

import pytest

from quick_tier import is_quick

WATCHED_SIGNALS = [s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGCHLD", None),
                               getattr(signal, "SIGUSR1", None), getattr(signal, "SIGPIPE", None)) if s is not None]
# Libraries set these on first use (torch's inductor cache, pytest itself): not the launcher's doing.
IGNORED_ENV = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"}


def _environment() -> dict:
    return {k: v for k, v in os.environ.items() if k not in IGNORED_ENV}


@pytest.fixture(scope="session", autouse=True)
def fork_server():
    from helpers.launcher import server

    server.start_server().wait_ready()
    yield
    server.stop_server()


@pytest.fixture(autouse=True)
def leaves_no_process():
    from helpers.launcher.server import processes_left

    yield
    left = processes_left()
    assert not left, f"processes left behind: {[(p.pid, p.status()) for p in left]}"


@pytest.fixture(autouse=True)
def launcher_leaves_kernel_as_it_was(request):
    if request.node.path.name != "test_launch.py":
        yield
        return
    env_before = _environment()
    handlers_before = {s: signal.getsignal(s) for s in WATCHED_SIGNALS}
    yield
    assert {s: signal.getsignal(s) for s in WATCHED_SIGNALS} == handlers_before, "signal handlers changed"
    assert _environment() == env_before, "the kernel's environment changed"


# The two notebooks whose smoke runs cost the most (05 and 06: 43% of the time notebooks 00-07 took, measured one
# at a time with papermill on the loaded 2-core machine): they never share the machine with each other or with the
# browser test. A notebook not named here may run beside any test.
HEAVY_NOTEBOOKS = {"05_mixed_precision", "06_checkpointing_and_fault_tolerance"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook turns the marks into node ids (`name@group`)
def pytest_collection_modifyitems(config, items):
    """`./cookbook test` runs three tests at a time (pytest-xdist, `--dist loadgroup`), each worker a process with its
    own fork-server, so the checks above hold per worker. The browser test (JupyterLab in Chromium, waiting on a
    page) and the two heaviest notebooks form one group, which one worker runs one after another; every other test,
    the lighter notebooks included, goes to whichever worker is free. The training recipe's tests form a group of
    their own: their runs are module-scoped fixtures, which xdist would otherwise make once on each worker that gets
    one of the tests (the same torchrun jobs twice). Without xdist the marks do nothing. Tests of the quick tier get
    the mark `quick`."""
    for item in items:
        if is_quick(item.nodeid):
            item.add_marker(pytest.mark.quick)
        if item.path.name == "test_train_recipe.py":
            item.add_marker(pytest.mark.xdist_group("recipe"))
            continue
        callspec = getattr(item, "callspec", None)
        if item.get_closest_marker("browser") or (item.get_closest_marker("notebook") and callspec is not None
                                                  and callspec.id in HEAVY_NOTEBOOKS):
            item.add_marker(pytest.mark.xdist_group("heavy"))


def _browser_can_run() -> bool:
    """Chromium, its driver and selenium are here, so tests/notebooks/test_browser.py runs rather than skips."""
    import importlib.util
    from pathlib import Path

    tools = (Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver"))
    return all(p.is_file() and os.access(p, os.X_OK) for p in tools) and importlib.util.find_spec("selenium") is not None


class _PapermillWhereTheBrowserRuns:
    """Registered by pytest_configure: its hook must run after -m and -k have deselected (trylast), while the group
    marks above must be set before pytest-xdist reads them, so the two cannot be one hook."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        _papermill_where_the_browser_runs(items)


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: the quick tier, what to run after an edit (tests/conftest.py, "
                                       "./cookbook test --quick)")
    config.pluginmanager.register(_PapermillWhereTheBrowserRuns(), "papermill-where-the-browser-runs")


def _papermill_where_the_browser_runs(items) -> None:
    """A notebook the browser test runs is not also run by papermill. tests/notebooks/test_browser.py executes every cell of
    its notebooks in JupyterLab with the same smoke parameters and fails on any error output, which is all the
    papermill test proves, at the cost of a second whole run. So where this session runs the browser test for a
    notebook (selected, not deselected with -m 'not browser', and its tools present), that notebook's papermill run
    is skipped, saying so."""
    browsed = {item.callspec.params["page"].notebook.removesuffix(".ipynb") for item in items
               if item.get_closest_marker("browser") and hasattr(item, "callspec")}
    if not browsed or not _browser_can_run():
        return
    for item in items:
        callspec = getattr(item, "callspec", None)
        if item.get_closest_marker("notebook") and callspec is not None and callspec.id in browsed:
            item.add_marker(pytest.mark.skip(reason="executed in JupyterLab by tests/notebooks/test_browser.py in this session "
                                                    "(the same smoke parameters; any error output fails it)"))
