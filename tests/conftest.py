"""No test may leave a process behind, nor anything a worker started (`processes_left` also finds what escaped the
tree); launcher tests also must leave signal handlers and environment as they were.

The launcher's fork-server is the one process allowed to outlive a test (it is started once and reused, as in a
kernel); its workers are not. It is started before the first test, so no launch's timing includes its start, and
stopped after the last one."""
from __future__ import annotations

import _thread
import contextlib
import os
import signal
import threading
import time

import pytest

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


@contextlib.contextmanager
def cell_interrupted_when(condition, timeout: float):
    """What Jupyter's interrupt button does to the kernel, as soon as `condition()` holds (looked at every 0.05 s)
    or `timeout` seconds into the block, whichever comes first.

    A kernel turns SIGINT into KeyboardInterrupt; a test runner started in the background may have inherited
    SIGINT as ignored, and then interrupt_main() does nothing. The block gets the kernel's handler.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    stop = threading.Event()

    def interrupt_when_ready():
        deadline = time.monotonic() + timeout
        while not stop.wait(0.05):
            if condition() or time.monotonic() > deadline:
                _thread.interrupt_main()
                return

    watcher = threading.Thread(target=interrupt_when_ready, daemon=True)
    try:
        watcher.start()
        yield
    finally:
        stop.set()
        watcher.join()
        signal.signal(signal.SIGINT, previous)


def cell_interrupted_after(seconds: float):
    """The interrupt button pressed `seconds` into the block."""
    return cell_interrupted_when(lambda: False, seconds)


# The quick tier, `./cookbook test --quick` (pytest -m quick): what a developer runs after an edit, in at most 3 minutes
# on a loaded 2-core machine; the full suite (`./cookbook test`, CI) runs everything. Unit areas are taken whole, so a
# new test file there is in the tier without a word; from the other areas the files and tests named. NOT_QUICK holds
# what of those costs too much for the tier (a test of 9 s or more here, a file of 30 s or more, the machine shared
# and busy): a test that shows among the slowest `./cookbook test --quick` prints belongs there. Paths below tests/.
QUICK_AREAS = ("launcher/", "plots/", "measure/", "planner/", "project/")  # launcher: its fault suite, its units
QUICK_FILES = (
    "notebooks/test_teaching.py", "notebooks/test_explore.py",  # the teaching checks
    "recipe/test_recipe_data.py",
)
QUICK_TESTS = (
    # the recipe's one-process run and one 2-rank layout (tests/recipe/test_train_recipe.py then makes only these runs)
    "recipe/test_train_recipe.py::test_one_process_trains",
    "recipe/test_train_recipe.py::test_a_layout_of_two_ranks_matches_one_process[fsdp]",
    # the course's order: each script made of its notebook's cells, each recipe module of one notebook's, in order
    "recipe/test_scripts.py::test_every_script_is_made_of_its_notebooks_cells",
    "recipe/test_scripts.py::test_a_recipe_module_is_made_of_several_notebooks_cells_in_notebook_order",
    "recipe/test_scripts.py::test_a_tag_outside_scripts_and_its_recipe_folder_is_refused",
    "recipe/test_scripts.py::test_a_script_imports_only_torch_numpy_and_the_standard_library",
    "recipe/test_train_recipe.py::test_the_recipe_imports_only_torch_numpy_torchdata_the_standard_library_and_itself",
)
NOT_QUICK = (
    "launcher/test_elastic.py",  # torchrun agents, a torch import each
    "launcher/test_torchrun.py",
    "launcher/test_launch.py::test_closures_defined_in_a_cell_work_with_either_start_method[spawn]",
    "launcher/test_launch.py::test_threads_split_the_cores_unless_the_user_says_otherwise[spawn]",
    "launcher/test_launch.py::test_a_server_whose_installation_changed_is_replaced",
    "launcher/test_launch.py::test_a_variable_torch_reads_at_import_restarts_the_server",
    "launcher/test_launch.py::test_a_cells_class_can_be_pickled_by_name_in_the_workers",
    "measure/test_ddp_measure.py",
    "measure/test_foundation_units.py::test_counting_gpus_creates_no_cuda_context",
    "measure/test_foundation_units.py::test_the_digits_file_holds_the_uci_test_set_as_scikit_learn_ships_it",
    "measure/test_fsdp_shards.py::test_formula_matches_a_real_fully_shard",
    "measure/test_tensor_parallel.py::test_graph_counter_counts_each_graph_and_refuses_an_unknown_backend",
    "planner/test_plan.py::test_activation_formula_is_what_a_forward_keeps",
    "planner/test_plan.py::test_llama3_70b_on_256_h100s_prints_layouts_and_a_line_the_recipe_accepts",
    "planner/test_plan.py::test_parameter_count_and_shapes_are_the_models",
    "planner/test_plan.py::test_model_state_and_collectives_match_fsdp2_and_ddp_on_two_ranks",
    "planner/test_plan_cp_moe.py::test_ring_and_experts_keep_and_send_what_the_plan_says_on_two_ranks",
    "planner/test_plan_cp_moe.py::test_moe_activations_are_what_a_forward_keeps",
    "project/test_private_names.py",
    "project/test_packaging.py",
    "project/test_budget_run.py::test_cells_after_an_error_still_run_and_figures_are_kept",
    "project/test_budget_run.py::test_a_hanging_notebook_is_stopped_at_the_budget_and_leaves_nothing_running",
    "project/test_suite.py::test_under_load_busy_processes_run_beside_pytest_and_the_cost_counts_an_orphan",
    "project/test_suite.py::test_ctrl_c_ends_pytest_and_then_the_busy_processes",
)


def is_quick(nodeid: str) -> bool:
    """In the quick tier: `nodeid` (tests/AREA/test_x.py::test_y[param]) is in a unit area or named, and not left out.
    A name without its [param] covers every parametrization; a file, its every test."""
    path = nodeid.removeprefix("tests/")

    def named(names) -> bool:
        return any(path == n or path.startswith(n + ("[" if "::" in n else "::")) for n in names)

    return (path.startswith(QUICK_AREAS) or named(QUICK_FILES) or named(QUICK_TESTS)) and not named(NOT_QUICK)


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
