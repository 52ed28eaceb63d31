"""Every notebook, executed top to bottom with papermill in smoke mode: any error or failed assert fails."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.run_notebooks import NOTEBOOKS, OUTPUTS, execute_notebook, notebook_paths

# Smoke mode must stay within a few minutes per notebook on 2 CPU cores.
NOTEBOOK_TIMEOUT_S = 3600  # ten times the slowest smoke run here (09: 301 s, the 2-core machine loaded)


@pytest.mark.notebook
@pytest.mark.timeout(NOTEBOOK_TIMEOUT_S)
@pytest.mark.parametrize("path", notebook_paths(), ids=lambda p: p.stem)
def test_notebook_runs_in_smoke_mode(path: Path):
    out, seconds = execute_notebook(path, smoke=True, out_dir=OUTPUTS / "smoke", cell_timeout=NOTEBOOK_TIMEOUT_S)
    executed = json.loads(out.read_text())
    assert any(c.get("outputs") for c in executed["cells"] if c["cell_type"] == "code")
    print(f"{path.name}: {seconds:.1f} s")


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
