"""tools.budget_run: every cell runs after an error, a notebook that hangs is stopped at the budget with what it
printed kept and nothing of it left running, a notebook stopped before its first cell is still in the archive, and
the output folder holds one archive (a device call brings back at most 8 files).

No test here waits for a time to pass: the budgets that run out do so at an event (a cell has begun, the notebook's
child has started), so a slow machine changes how long a test takes, not what it finds."""
from __future__ import annotations

import json
import math
import tarfile

import nbformat
import psutil
import pytest

from tools.budget_run import ARCHIVE, Budget, Session, failed_tests, parse_arguments, run_notebooks


def write_notebook(path, *sources):
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                           "language": "python"}})
    nb.cells = [nbformat.v4.new_code_cell("SMOKE = False", metadata={"tags": ["parameters"]})]
    nb.cells += [nbformat.v4.new_code_cell(src) for src in sources]
    nbformat.write(nb, str(path))
    return path


def index_of(cells: list, text: str) -> int:
    """The cell whose source holds `text` (papermill inserts its parameters cell, so positions shift)."""
    return next(i for i, c in enumerate(cells) if text in "".join(c["source"]))


class SpentWhen(Budget):
    """A budget that runs out once `condition()` has held, and never by the clock."""

    def __init__(self, condition):
        super().__init__(math.inf)
        self.condition, self.spent = condition, False

    def left(self) -> float:
        self.spent = self.spent or self.condition()
        return 0.0 if self.spent else math.inf


def notebook_child_started() -> bool:
    """A child of this process runs `tools.budget_run _one`: the process that executes one notebook."""
    for child in psutil.Process().children():
        try:
            if "_one" in child.cmdline():
                return True
        except psutil.Error:  # gone, or a zombie: not the one we wait for
            pass
    return False


def run(tmp_path, mode: str, budget: Budget, *notebooks: tuple[str, ...]) -> tuple[Session, bool, list[dict]]:
    """Write each (name, *cell sources) as a notebook, run them all within `budget`: the session, whether every
    one ran clean, and the records the archive's summary.json holds."""
    paths = [write_notebook(tmp_path / f"{name}.ipynb", *sources) for name, *sources in notebooks]
    session = Session(tmp_path / "out", mode, f"budget_run {mode}")
    ok = run_notebooks(session, paths, budget)
    return session, ok, json.loads(archived(session, "summary.json"))


def archived(session: Session, name: str) -> str:
    """A file of the archive in the output folder: what comes back from a device call."""
    with tarfile.open(session.out / ARCHIVE) as tar:
        return tar.extractfile(f"budget_run/{name}").read().decode()


def executed(session: Session, name: str) -> dict:
    return json.loads(archived(session, f"{session.mode}/{name}.{session.mode}.ipynb"))


def test_cells_after_an_error_still_run_and_figures_are_kept(tmp_path):
    session, ok, records = run(tmp_path, "smoke", Budget(math.inf), (
        "01_errors",
        "print('smoke is', SMOKE)",
        "raise ValueError('cell two fails')",
        "from helpers.measure.headline import headline\nheadline('answer', 42.0, 'units')",
    ))
    record = records[-1]
    assert ok is False
    cells = executed(session, "01_errors")["cells"]
    assert record["status"] == "ran"
    assert [(c["cell"], c["ename"]) for c in record["failing_cells"]] == [(index_of(cells, "raise"), "ValueError")]
    assert record["figures"] == [{"name": "answer", "value": 42.0, "unit": "units"}]
    assert "smoke is True" in "".join(cells[index_of(cells, "print")]["outputs"][0]["text"])  # papermill's SMOKE
    assert "answer = 42 units" in archived(session, "figures.md")


def test_a_hanging_notebook_is_stopped_at_the_budget_and_leaves_nothing_running(tmp_path):
    hanging = tmp_path / "the hanging cell has begun"
    session, ok, records = run(tmp_path, "full", SpentWhen(hanging.exists), (
        "02_hangs",
        "import subprocess\nchild = subprocess.Popen(['sleep', '600'], start_new_session=True)\nprint('pid', child.pid)",
        f"import pathlib, time\npathlib.Path({str(hanging)!r}).touch()\ntime.sleep(600)",
        "print('never reached')",
    ), ("03_later", "print('later')"))
    assert ok is False
    notebook = executed(session, "02_hangs")
    cells = notebook["cells"]
    assert records[0]["status"].startswith("stopped at the budget")
    assert notebook["metadata"]["budget_run"]["status"] == records[0]["status"]
    assert [(c["cell"], c["ename"]) for c in records[0]["failing_cells"]] == [(index_of(cells, "sleep(600)"),
                                                                                 "Stopped")]
    assert notebook["metadata"]["budget_run"]["stopped_at"]["cell"] == index_of(cells, "sleep(600)")
    assert records[1]["status"] == "not started (budget spent)"
    pid = int("".join(cells[index_of(cells, "Popen")]["outputs"][0]["text"]).split()[1])
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert cells[index_of(cells, "never reached")].get("outputs") == []
    assert [p.name for p in session.out.iterdir()] == [ARCHIVE]
    with tarfile.open(session.out / ARCHIVE) as tar:
        assert {f"budget_run/{name}" for name in ("summary.json", "figures.md", "full/02_hangs.full.ipynb",
                                                  "full/02_hangs.full.log")} <= set(tar.getnames())


def test_a_notebook_stopped_before_its_first_cell_is_in_the_archive_with_where_it_stopped(tmp_path):
    """The budget runs out the moment the notebook's child exists, before its interpreter could have started a
    kernel, let alone run a cell: the archive still holds the notebook, and says where it stopped."""
    session, ok, records = run(tmp_path, "full", SpentWhen(notebook_child_started), (
        "04_never_begun", "print('first')", "print('second')"))
    assert ok is False
    notebook = executed(session, "04_never_begun")
    cells = notebook["cells"]
    assert records[0]["status"].startswith("stopped at the budget")
    assert [(c["cell"], c["ename"]) for c in records[0]["failing_cells"]] == [(0, "Stopped")]
    assert "the notebook's first cell" in records[0]["failing_cells"][0]["evalue"]
    assert notebook["metadata"]["budget_run"]["status"] == records[0]["status"]
    assert notebook["metadata"]["budget_run"]["stopped_at"]["cell"] == 0
    assert all(c.get("outputs") == [] for c in cells if c["cell_type"] == "code")
    assert {"print('first')", "print('second')"} <= {"".join(c["source"]) for c in cells}


def test_arguments_after_the_separator_go_to_pytest_untouched():
    args, rest = parse_arguments(["tests", "--budget", "60", "--", "-m", "not browser", "-k", "launch"])
    assert (args.mode, args.budget, rest) == ("tests", 60.0, ["-m", "not browser", "-k", "launch"])
    args, rest = parse_arguments(["full", "05", "03b", "--budget", "300", "--out", "/tmp/x"])
    assert (args.mode, args.budget, str(args.out), rest) == ("full", 300.0, "/tmp/x", ["05", "03b"])
    with pytest.raises(SystemExit):
        parse_arguments(["tests", "tests/launcher/test_launch.py"])  # a pytest argument without -- is refused, not dropped


def test_failed_tests_are_named_from_the_per_test_lines_even_without_pytests_summary():
    cut_short = ("[gw1] [ 41%] PASSED tests/test_a.py::test_fine\n"
                 "[gw0] [ 42%] FAILED tests/test_b.py::test_broken[fsdp]\n"
                 "tests/test_c.py::test_serial FAILED                [ 43%]\n"
                 "[gw3] [ 44%] ERROR tests/test_d.py::test_fixture\n")   # stopped here: no summary
    assert failed_tests(cut_short) == [("FAILED", "tests/test_b.py::test_broken[fsdp]"),
                                       ("ERROR", "tests/test_d.py::test_fixture"),
                                       ("FAILED", "tests/test_c.py::test_serial")]
    assert failed_tests("FAILED tests/test_b.py::test_broken - AssertionError: x\n") == \
        [("FAILED", "tests/test_b.py::test_broken")]
