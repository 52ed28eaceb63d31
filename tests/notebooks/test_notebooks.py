"""Every notebook, executed top to bottom with papermill in smoke mode: any error or failed assert fails."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from smoke_runs import NOTEBOOK_TIMEOUT_S
from tools.run_notebooks import NOTEBOOKS, notebook_paths


@pytest.mark.notebook
@pytest.mark.timeout(NOTEBOOK_TIMEOUT_S)
@pytest.mark.parametrize("path", notebook_paths(), ids=lambda p: p.stem)
def test_notebook_runs_in_smoke_mode(path: Path, smoke_runs, request):
    """The session's one smoke run of the notebook (tests/notebooks/smoke_runs.py): this test's own, or the one
    another test of the session made (test_site.py's), whose error, had there been one, fails this test too."""
    out, made_by = smoke_runs.executed(path, request.node.nodeid)
    executed = json.loads(out.read_text())
    assert any(c.get("outputs") for c in executed["cells"] if c["cell_type"] == "code")
    if made_by != request.node.nodeid:
        print(f"{path.name}: the run {made_by} made in this session")


def test_there_are_notebooks():
    assert notebook_paths(), f"no notebooks in {NOTEBOOKS}"


@pytest.mark.parametrize("path", notebook_paths(), ids=lambda p: p.stem)
def test_committed_notebook_has_no_outputs_and_a_parameters_cell(path: Path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), \
        f"{path.name} carries outputs: clear them before committing"
    tagged = [c for c in code if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"{path.name} needs exactly one cell tagged 'parameters'"
    assert "SMOKE" in "".join(tagged[0]["source"])


@pytest.mark.parametrize("path", notebook_paths(), ids=lambda p: p.stem)
def test_every_parameter_is_one_papermill_can_override(path: Path):
    """papermill silently skips a parameter line it cannot parse (a comment starting 'None:' is enough)."""
    from papermill.inspection import _infer_parameters
    from papermill.iorw import load_notebook_node

    nb = load_notebook_node(str(path))  # papermill's own loader, as execute_notebook uses
    cell = next(c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", []))
    assigned = [line.split("=")[0].strip() for line in cell.source.splitlines()
                if line and not line.startswith((" ", "#")) and "=" in line]
    assert [p.name for p in _infer_parameters(nb)] == assigned


def test_a_notebook_runs_once_a_session_and_its_failure_fails_every_test_that_asks(tmp_path: Path):
    """Two askers of each of two planted notebooks (SmokeRuns, as the fixture smoke_runs makes it): each notebook
    runs once (it counts its runs in a file); the second asker of the failing one fails with the first one's error
    rather than running it again."""
    from smoke_runs import SmokeRuns

    counter = tmp_path / "runs.txt"
    for name, last in (("ok", "print('fine')"), ("fails", "raise ValueError('a planted failure')")):
        cells = [{"cell_type": "code", "metadata": {"tags": ["parameters"]}, "source": "SMOKE = False"},
                 {"cell_type": "code", "metadata": {}, "source": f"open({str(counter)!r}, 'a').write({name!r} + '\\n')"},
                 {"cell_type": "code", "metadata": {}, "source": last}]
        nb = {"cells": [{"id": f"c{i}", "execution_count": None, "outputs": [], **c} for i, c in enumerate(cells)],
              "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
              "nbformat": 4, "nbformat_minor": 5}
        (tmp_path / f"{name}.ipynb").write_text(json.dumps(nb))
    (tmp_path / "runs").mkdir()
    runs = SmokeRuns(tmp_path / "runs", out_dir=tmp_path / "executed")

    first, second = (runs.executed(tmp_path / "ok.ipynb", asked_by) for asked_by in ("test one", "test two"))
    assert first == second == (tmp_path / "executed" / "ok.ipynb", "test one")
    assert "fine" in first[0].read_text()
    with pytest.raises(Exception, match="a planted failure"):
        runs.executed(tmp_path / "fails.ipynb", "test one")
    with pytest.raises(pytest.fail.Exception, match="made by test one, failed:(.|\n)*a planted failure"):
        runs.executed(tmp_path / "fails.ipynb", "test two")
    assert counter.read_text().split() == ["ok", "fails"]
