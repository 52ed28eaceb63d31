"""The course goes forward only (tools/course_order.py): no notebook imports a module, or runs a program, that a
later notebook writes, directly or through the modules that program imports; each file of scripts/ has one writer.
Planted notebooks show that each rule fails when it should and stays quiet where a path is only shown."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.course_order import main, read_course, violations

EARLY = "def run():\n    from late import helper  # only a later notebook writes late.py\n    return helper()\n"


def _write(folder: Path, name: str, *cells: str | tuple[str, str]) -> None:
    """A notebook of code cells (a tuple is (script tag, source)) and one markdown cell that names a path."""
    code = [{"cell_type": "code", "id": f"c{i}", "outputs": [], "execution_count": None,
             "metadata": {"tags": [f"script:{cell[0]}"]} if isinstance(cell, tuple) else {},
             "source": cell[1] if isinstance(cell, tuple) else cell} for i, cell in enumerate(cells)]
    markdown = {"cell_type": "markdown", "id": "m", "metadata": {},
                "source": "notebook 09 runs this as `torchrun scripts/train/late.py --tp 2`"}
    (folder / name).write_text(json.dumps({"cells": code + [markdown], "metadata": {}, "nbformat": 4,
                                           "nbformat_minor": 5}))


@pytest.fixture
def course(tmp_path: Path) -> Path:
    """01 writes early.py, which imports late.py only inside a function; 03 writes late.py; 02 is planted by each
    test between them."""
    _write(tmp_path, "01_first.ipynb", ("train/early.py", EARLY))
    _write(tmp_path, "03_third.ipynb", ("train/late.py", "def helper():\n    return 3\n"),
           'run_torchrun(SCRIPTS / "train" / "late.py", "--steps", 2)')
    return tmp_path


def _found(folder: Path) -> list[str]:
    return violations(read_course(folder))


EARLY_IMPORTS_LATE = "01_first.ipynb cell 0 (c0): imports late (scripts/train/late.py), which 03_third.ipynb writes"


@pytest.mark.parametrize("source", [
    'from helpers.cluster.torchrun import run_torchrun\nrun_torchrun(SCRIPTS / "train" / "late.py", nproc=2)',
    'run_torchrun(helpers.paths.SCRIPTS / "train" / "late.py")',
    'RECIPE = SCRIPTS / "train" / "late.py"\nrun = run_torchrun(RECIPE, "--tp", 2)',
    'import subprocess, sys\nsubprocess.run([sys.executable, str(REPO / "scripts" / "train" / "late.py")])',
    'subprocess.run("torchrun --nproc-per-node=2 ../scripts/train/late.py", shell=True)',
    '!torchrun --standalone --nproc-per-node=2 ../scripts/train/late.py --steps 2',
    '%run ../scripts/train/late.py',
    'agent = start_agent("node_a", SCRIPTS / "train/late.py", log_dir=OUT)',
    'def go(*flags):\n    return run_torchrun(*flags)\n\n\ngo(SCRIPTS / "train" / "late.py")',
], ids=["run_torchrun", "helpers.paths", "a name", "subprocess list", "shell line", "!torchrun", "%run",
        "start_agent", "a function of the cells"])
def test_a_program_written_later_is_found_however_it_is_started(course, source):
    _write(course, "02_second.ipynb", source)
    assert _found(course) == [EARLY_IMPORTS_LATE, "02_second.ipynb cell 0 (c0): runs scripts/train/late.py, which "
                                             "03_third.ipynb writes"]


def test_a_program_written_earlier_that_imports_a_later_module_is_found(course):
    _write(course, "02_second.ipynb", 'import subprocess\nsubprocess.run(["python", "scripts/train/early.py"])')
    assert _found(course) == [EARLY_IMPORTS_LATE, "02_second.ipynb cell 0 (c0): runs scripts/train/early.py, which imports "
                                             "train/late.py (03), written after 02"]


@pytest.mark.parametrize("source", ["from late import helper", "import late", "def f():\n    import late.sub\n",
                                    'import importlib\nlate = importlib.import_module("late")',
                                    "%%distributed\nfrom late import helper"],
                         ids=["from", "import", "inside a function", "importlib", "%%distributed"])
def test_an_import_of_a_later_module_is_found(course, source):
    _write(course, "02_second.ipynb", source)
    assert _found(course) == [EARLY_IMPORTS_LATE, "02_second.ipynb cell 0 (c0): imports late (scripts/train/late.py), "
                                             "which 03_third.ipynb writes"]


@pytest.mark.parametrize("source", [
    'print(torchrun_lines("scripts/train/late.py"))',                    # shows the lines, runs nothing
    'LINES = ["torchrun --nproc-per-node=8 scripts/train/late.py --tp 2"]\nprint(*LINES)',
    'results = pool.run(worker, SCRIPTS / "train" / "late.py")',       # a worker handed a path: not a launcher
    'run_torchrun(SCRIPTS / "train" / "early.py".replace("early", "x"))',  # a path it cannot read: no claim
    'from early import run\nrun_torchrun(SCRIPTS / "hello.py")',
], ids=["torchrun_lines", "a string shown", "a worker's argument", "an unreadable path", "earlier ones"])
def test_a_path_shown_or_a_script_written_earlier_is_no_violation(course, source):
    _write(course, "00_zero.ipynb", ("hello.py", "print('hello')\n"))
    _write(course, "02_second.ipynb", source)
    assert _found(course) == [EARLY_IMPORTS_LATE]


def test_a_notebook_runs_the_script_its_own_cells_write(course):
    _write(course, "02_second.ipynb", 'run_torchrun(SCRIPTS / "own.py")', ("own.py", "import json\n"))
    assert _found(course) == [EARLY_IMPORTS_LATE]


def test_a_file_written_by_two_notebooks_or_none_is_found(course):
    _write(course, "02_second.ipynb", ("train/early.py", "x = 1\n"), 'run_torchrun(SCRIPTS / "missing.py")')
    found = _found(course)
    assert "scripts/train/early.py is written by several notebooks: 01_first.ipynb, 02_second.ipynb" in found
    assert "02_second.ipynb cell 1 (c1): runs scripts/missing.py, which no notebook writes" in found


def test_the_command_line_prints_a_line_per_violation_and_exits_1(course, capsys):
    _write(course, "02_second.ipynb", "import late", '!python ../scripts/train/late.py')
    assert main([str(course)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(line.startswith("course-order: ") for line in lines)


def test_a_folder_without_notebooks_is_bad_input(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no notebooks" in err


def test_the_course_goes_forward_only(capsys):
    found = violations(read_course())
    assert found == [], "\n".join(found)
    assert main([]) == 0 and capsys.readouterr().out.count("\n") == 1


def test_a_module_whose_cells_run_a_later_program_is_found_where_it_is_written(course):
    """A notebook that imports an earlier module which starts a later program: the module's own cells are where
    the course reaches ahead, and they are reported."""
    runner = 'import subprocess, sys\n\n\ndef go():\n    subprocess.run([sys.executable, "scripts/train/late.py"])\n'
    _write(course, "02_second.ipynb", ("train/runner.py", runner), "from runner import go\ngo()")
    assert _found(course) == [EARLY_IMPORTS_LATE, "02_second.ipynb cell 0 (c0): runs scripts/train/late.py, which "
                                             "03_third.ipynb writes"]
