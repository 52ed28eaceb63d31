"""Every name a notebook's code uses is defined: checked statically, because some cells never run here.

A branch taken only on a GPU machine (`if facts["gpus"] >= 1:`), or only at full size, is skipped by the smoke run
on a CPU, so papermill cannot see a name it lost when a notebook was split or a helper renamed. pyflakes reads the
code without running it; the notebook's cells, in order, are read as one module, as the kernel runs them.
"""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from pyflakes import checker, messages

from tools.run_notebooks import notebook_paths

IPYTHON_BUILTINS = {"display", "get_ipython"}  # names IPython puts in every kernel's namespace


def notebook_source(path: Path) -> str:
    """The code cells in order, IPython's magics and shell lines left out (a `%%distributed` cell keeps its body)."""
    cells = []
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "code":
            lines = "".join(cell["source"]).splitlines()
            cells.append("\n".join(line for line in lines if not line.lstrip().startswith(("%", "!"))))
    return "\n\n".join(cells) + "\n"


def undefined_names(source: str, filename: str) -> list[str]:
    found = checker.Checker(ast.parse(source, filename), filename, builtins=IPYTHON_BUILTINS).messages
    return [str(m) for m in found if isinstance(m, (messages.UndefinedName, messages.UndefinedLocal))]


def test_the_check_finds_a_name_only_a_gpu_branch_uses():
    source = "facts = {'gpus': 0}\nif facts['gpus'] >= 1:\n    print(build_variant())\n"
    assert [m.split(": ", 1)[1] for m in undefined_names(source, "nb.py")] == ["undefined name 'build_variant'"]
    assert undefined_names("display(1)\nget_ipython()\n", "nb.py") == []


@pytest.mark.parametrize("path", notebook_paths(), ids=lambda p: p.stem)
def test_every_name_the_notebook_uses_is_defined(path: Path):
    problems = undefined_names(notebook_source(path), path.name)
    assert not problems, "\n".join(problems)
