"""tools/suite.py, what `./cookbook test` runs: --under-load starts a busy process per core before pytest and ends
them after it, a normal end and Ctrl-C alike; the cost it prints counts the CPU of the whole tree, orphans
included; --quick selects the `quick` mark and says what it left out.

Each run here is tools.suite on a small test file of its own, in a folder of its own (no conftest, no fork-server).
Nothing waits for a time to pass: the outer test waits for files the inner one writes, with deadlines far beyond
what they need (a few seconds on a loaded 2-core machine)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from quick_tier import is_quick
from helpers.paths import REPO_ROOT
from tools.suite import BUSY_TAG, cores, left_out_lines, quick_selection
from tools.suite_plugin import REPORT_VAR

WAIT_S = 300  # any one wait here: what it waits for takes seconds


INNER = """
import json, os, pathlib, resource, subprocess, sys, time
import psutil

HERE = pathlib.Path(__file__).parent
BURN = '''
import pathlib, resource, sys
cpu = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_utime
while cpu() < 0.5:
    pass
pathlib.Path(sys.argv[1]).write_text(str(cpu()))
'''


def wait_for(path):
    deadline = time.monotonic() + 300
    while not path.exists():
        assert time.monotonic() < deadline, f"waited 300 s for {path}"
        time.sleep(0.05)


def test_beside_the_busy_processes():
    wrapper = psutil.Process(os.getppid())
    busy = [p.pid for p in wrapper.children() if BUSY_TAG in " ".join(p.cmdline())]
    (HERE / "busy.json").write_text(json.dumps(busy))
    if os.environ.get("ORPHAN"):  # a process whose parent exits at once: re-parented, burns CPU, ends
        subprocess.run([sys.executable, "-c", "import subprocess, sys; subprocess.Popen("
                        f"[sys.executable, '-c', {BURN!r}, {str(HERE / 'burnt')!r}], start_new_session=True)"],
                       check=True)
        wait_for(HERE / "burnt")
    if os.environ.get("HANG"):
        (HERE / "ready").touch()
        time.sleep(600)
"""


def start_suite(tmp_path, *options, **env) -> subprocess.Popen:
    """tools.suite with `options` on INNER's one test, in a session of its own (a terminal's Ctrl-C reaches the
    whole process group: this is the group)."""
    (tmp_path / "test_inner.py").write_text(f"BUSY_TAG = {BUSY_TAG!r}\n" + INNER)
    return subprocess.Popen([sys.executable, "-m", "tools.suite", *options, "--", "-q", "-p", "no:cacheprovider",
                             "-p", "no:xdist", "test_inner.py"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, **env, "PYTHONPATH": str(REPO_ROOT)})


def gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_under_load_busy_processes_run_beside_pytest_and_the_cost_counts_an_orphan(tmp_path):
    suite = start_suite(tmp_path, "--under-load", ORPHAN="1")
    out, _ = suite.communicate(timeout=WAIT_S)
    assert suite.returncode == 0, out
    busy = json.loads((tmp_path / "busy.json").read_text())
    assert len(busy) == cores() >= 1, "one busy process per core, running while the test ran"
    assert all(gone(pid) for pid in busy), "the busy processes ended with the suite"
    spent = re.search(r"CPU ([\d.]+) s \(user", out)
    orphans = re.search(r"orphans adopted and reaped here: (\d+) processes, ([\d.]+) s", out)
    busy_cpu = re.search(rf"under load: {cores()} busy processes beside it, ([\d.]+) s of CPU", out)
    assert spent and orphans and busy_cpu, out
    burnt = float((tmp_path / "burnt").read_text())  # what the orphan measured of itself just before it ended
    assert int(orphans[1]) >= 1 and float(orphans[2]) >= round(burnt, 1) - 0.05, out
    assert float(spent[1]) >= float(orphans[2]), "the orphans' CPU is part of the suite's"
    assert float(busy_cpu[1]) > 0, out
    assert "the 1 slowest tests" in out and "test_inner.py::test_beside_the_busy_processes" in out, out


def test_ctrl_c_ends_pytest_and_then_the_busy_processes(tmp_path):
    suite = start_suite(tmp_path, "--under-load", HANG="1")
    try:
        deadline = time.monotonic() + WAIT_S
        while not (tmp_path / "ready").exists():
            assert suite.poll() is None and time.monotonic() < deadline, suite.communicate()[0]
            time.sleep(0.1)
        busy = json.loads((tmp_path / "busy.json").read_text())
        pytest_pid = [p.pid for p in psutil.Process(suite.pid).children() if "pytest" in " ".join(p.cmdline())]
        os.killpg(suite.pid, signal.SIGINT)  # what the terminal's Ctrl-C does
        out, _ = suite.communicate(timeout=WAIT_S)
    finally:
        if suite.poll() is None:
            os.killpg(suite.pid, signal.SIGKILL)
            suite.wait()
    assert suite.returncode != 0 and "KeyboardInterrupt" in out, out
    assert len(busy) == cores() and all(gone(pid) for pid in busy + pytest_pid), out
    busy_cpu = re.search(rf"under load: {cores()} busy processes beside it, ([\d.]+) s of CPU", out)
    assert busy_cpu and float(busy_cpu[1]) > 0, "tools.suite itself ended and reaped them, once pytest had ended"
    assert "suite cost:" in out, "the cost is printed after an interrupted run too"


def test_the_plugin_reports_nothing_unless_asked(tmp_path):
    """Loaded without the variable (pytest run directly, not by tools.suite), the plugin writes no file."""
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != REPORT_VAR}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tools.suite_plugin",
                           "test_one.py"], cwd=tmp_path, env={**env, "PYTHONPATH": str(REPO_ROOT)},
                          capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith((".", "__"))) == ["test_one.py"]


CPU_INNER = """
import pathlib, subprocess, sys, time

HERE = pathlib.Path(__file__).parent
BURN = '''
import pathlib, resource, sys
cpu = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
while cpu() < 1.0:
    pass
pathlib.Path(sys.argv[1]).write_text(str(cpu()))
'''
# outlives the test that starts it, as the fork-server does, and reaps the child it burns in
KEEPER = '''
import pathlib, subprocess, sys
subprocess.run([sys.executable, "-c", sys.argv[1], sys.argv[2]], check=True)
pathlib.Path(sys.argv[3]).touch()
sys.stdin.read()
'''
kept = []


def test_burns_in_a_child_and_below_a_child_still_running():
    subprocess.run([sys.executable, "-c", BURN, str(HERE / "child")], check=True)
    kept.append(subprocess.Popen([sys.executable, "-c", KEEPER, BURN, str(HERE / "grandchild"), str(HERE / "reaped")],
                                 stdin=subprocess.PIPE))
    deadline = time.monotonic() + 300
    while not (HERE / "reaped").exists():
        assert kept[0].poll() is None and time.monotonic() < deadline
        time.sleep(0.05)


def test_ends_the_child_still_running():
    kept[0].stdin.close()
    assert kept[0].wait() == 0
"""


def test_each_tests_cpu_counts_its_children_and_what_a_running_child_reaped_once(tmp_path):
    """Two tests under pytest-xdist (one worker, so in order): the first burns 1 s of CPU in a child it waits for
    and 1 s in a grandchild below a child it leaves running; the second ends that child. The first must count both
    seconds, the second neither again."""
    (tmp_path / "test_inner.py").write_text(CPU_INNER)
    done = subprocess.run([sys.executable, "-m", "tools.suite", "--", "-q", "-p", "no:cacheprovider", "-n", "1",
                           "test_inner.py"], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                          capture_output=True, text=True, timeout=WAIT_S, stdin=subprocess.DEVNULL)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    cpu = {m[2]: float(m[1]) for m in re.finditer(r"^ +([\d.]+) s CPU \(user .*? s wall +test_inner\.py::(\w+)$", out,
                                                 re.M)}
    first, second = "test_burns_in_a_child_and_below_a_child_still_running", "test_ends_the_child_still_running"
    assert set(cpu) == {first, second}, out
    burnt = sum(float((tmp_path / name).read_text()) for name in ("child", "grandchild"))
    # printed to 0.1 s; beyond the 2 s burnt, the first test starts three interpreters (about 0.1 s of CPU each)
    assert burnt - 0.1 <= cpu[first] < burnt + 2.0, out
    assert cpu[second] < 0.5, "the grandchild's second, reaped by the child before this test, counts once, in the first"
    in_tests = re.search(r"CPU in the tests themselves: ([\d.]+) s", out)
    assert in_tests and float(in_tests[1]) >= cpu[first] + cpu[second] - 0.1, out


def test_quick_joins_a_mark_expression_of_the_callers():
    assert quick_selection(["-n", "3", "tests/recipe"]) == ["-n", "3", "tests/recipe", "-m", "quick"]
    assert quick_selection(["-m", "not browser", "-k", "x"]) == ["-m", "quick and (not browser)", "-k", "x"]
    assert quick_selection(["-mnot browser"]) == ["-mquick and (not browser)"]


def test_what_quick_left_out_is_listed_by_area_then_by_file_where_an_area_ran_in_part():
    collected = {"tests/notebooks/test_notebooks.py": 20, "tests/notebooks/test_teaching.py": 5,
                 "tests/plots/test_a.py": 3, "tests/launcher/test_launch.py": 10,
                 "tests/launcher/test_elastic.py": 4}
    left_out = {"tests/notebooks/test_notebooks.py": 20, "tests/launcher/test_elastic.py": 4}
    assert left_out_lines(collected, left_out) == [
        "--quick left out 24 of 42 tests (./cookbook test runs them all):",
        "  tests/launcher: 4 of 14",
        "    tests/launcher/test_elastic.py: 4 of 4",
        "  tests/notebooks: 20 of 25",
        "    tests/notebooks/test_notebooks.py: 20 of 20",
    ]
    assert left_out_lines({"tests/notebooks/test_notebooks.py": 2}, {"tests/notebooks/test_notebooks.py": 2})[1] == \
        "  tests/notebooks: 2 of 2 (the whole area)"


@pytest.mark.parametrize("nodeid, quick", [
    ("tests/plots/test_a_new_topic.py::test_anything", True),  # a new unit file in a unit area is in it, unnamed
    ("tests/notebooks/test_notebooks.py::test_notebook_runs_in_smoke_mode[00_launching_workers]", False),
    ("tests/notebooks/test_teaching.py::test_anything", True),
    ("tests/recipe/test_train_recipe.py::test_one_process_trains", True),
    ("tests/recipe/test_train_recipe.py::test_a_layout_of_two_ranks_matches_one_process[tp]", False),
])
def test_the_quick_tier_takes_unit_areas_whole_and_names_the_rest(nodeid, quick):
    assert is_quick(nodeid) is quick
