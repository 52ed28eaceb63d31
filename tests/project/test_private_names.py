"""Private names stay private: torch's have one home (helpers/torch_private.py), the project's own stay in their module.

A private torch API may vanish in any release: each one the project uses is resolved here, and a removed one fails
a test that names it and its users. The helpers and tools take every private torch API from torch_private; a
notebook's cells, a script or a benchmark may name only those torch_private lists for that file (`named_in`: a
worker that imports no helpers, a lesson that shows the call). A module that imports another project module's
`_private` name (or reaches it as `module._name`) couples the two through something the other never promised.
Each file is its own test, so a failure names the file (and, in a notebook, the cell)."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from helpers import torch_private

ROOT = Path(__file__).resolve().parents[2]
PROJECT_PACKAGES = ("helpers", "tools")
SOURCES = sorted(p for package in PROJECT_PACKAGES if (ROOT / package).is_dir()
                 for p in (ROOT / package).rglob("*.py"))
HOME = ROOT / "helpers" / "torch_private.py"
# What a reader runs or copies: the notebooks' code cells, scripts/ (the recipe included), benchmarks/
ELSEWHERE = sorted([*(ROOT / "notebooks").glob("*.ipynb"), *(ROOT / "scripts").rglob("*.py"),
                    *(ROOT / "benchmarks").glob("*.py")])


def _trees(path: Path) -> list[tuple[str, ast.AST]]:
    """(where, syntax tree) of a Python file, or of each code cell of a notebook ('cell N, '), IPython's magics turned
    into Python as a kernel does; a cell magic's body counts only where it is Python run on ranks (%%distributed)."""
    if path.suffix != ".ipynb":
        return [("", ast.parse(path.read_text(), str(path)))]
    from IPython.core.inputtransformer2 import TransformerManager

    transform = TransformerManager().transform_cell
    trees = []
    for index, cell in enumerate(json.loads(path.read_text())["cells"]):
        source = "".join(cell["source"])
        if cell["cell_type"] != "code":
            continue
        if source.startswith("%%"):
            magic, _, source = source.partition("\n")
            if magic.split()[0] != "%%distributed":
                continue
        trees.append((f"cell {index}, ", ast.parse(transform(source), f"{path.name}, cell {index}")))
    return trees


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, path: Path) -> str:
    """The module an ImportFrom names, relative imports resolved against `path`'s package."""
    if not node.level:
        return node.module or ""
    package = _module_of(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[:len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _aliases(tree: ast.AST, path: Path, roots: tuple[str, ...]) -> dict[str, str]:
    """Local names bound to modules under `roots` (`import torch.distributed as dist` -> {'dist': ...})."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in roots:
                    bound[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else \
                        alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, path)
            if module.split(".")[0] in roots:
                for alias in node.names:
                    bound[alias.asname or alias.name] = f"{module}.{alias.name}"
    return bound


def _chain(node: ast.Attribute) -> tuple[str | None, list[str]]:
    """`a.b.c` -> ('a', ['b', 'c'])."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id if isinstance(node, ast.Name) else None), attrs[::-1]


def private_torch_names(path: Path) -> list[tuple[str, str]]:
    """(where, the private torch name in full) for every reach of `path` into a private torch name: an import, or an
    attribute chain from a name bound to a torch module (`dist._x` is 'torch.distributed._x')."""
    trees = _trees(path)
    torch_names = {k: v for _, tree in trees for k, v in _aliases(tree, path, ("torch",)).items()}
    found = []
    for where, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch" and not node.level:
                found += [(f"{where}line {node.lineno}", f"{node.module}.{a.name}") for a in node.names
                          if any(_private(p) for p in node.module.split(".") + [a.name])]
            elif isinstance(node, ast.Import):
                found += [(f"{where}line {node.lineno}", a.name) for a in node.names
                          if a.name.split(".")[0] == "torch" and any(_private(p) for p in a.name.split("."))]
        _mark_parents(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None), ast.Attribute):
                root, attrs = _chain(node)
                if root in torch_names and any(_private(a) for a in attrs):
                    found.append((f"{where}line {node.lineno}", f"{torch_names[root]}.{'.'.join(attrs)}"))
    return sorted(set(found))


def private_torch_uses(path: Path) -> list[str]:
    return [f"{where}: {name}" for where, name in private_torch_names(path)]


def private_project_imports(path: Path) -> list[str]:
    trees = _trees(path)
    here = _module_of(path)
    modules = {k: v for _, tree in trees for k, v in _aliases(tree, path, PROJECT_PACKAGES).items()}
    found = []
    for where, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = _absolute(node, path)
                if module.split(".")[0] in PROJECT_PACKAGES and module != here:
                    found += [f"{where}line {node.lineno}: from {module} import {a.name}" for a in node.names
                              if _private(a.name)]
        _mark_parents(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None), ast.Attribute):
                root, attrs = _chain(node)
                if root in modules and modules[root] != here and any(_private(a) for a in attrs):
                    found.append(f"{where}line {node.lineno}: {root}.{'.'.join(attrs)} ({modules[root]})")
    return sorted(set(found))


def _mark_parents(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            child.parent = node


@pytest.mark.parametrize("name", sorted(torch_private.PRIVATE))
def test_every_private_torch_api_the_helpers_use_is_in_this_torch(name):
    torch_private.resolve(name)  # raises PrivateAPIGone, naming the API, its users and why it is needed


def test_a_removed_private_api_is_named_with_its_users(monkeypatch):
    monkeypatch.setitem(torch_private.PRIVATE, "gone", torch_private.PrivateAPI(
        "torch.utils", "_no_such_thing", "helpers/example.py", "no public API does this"))
    with pytest.raises(torch_private.PrivateAPIGone, match=r"torch\.utils\._no_such_thing.*helpers/example\.py"):
        torch_private.resolve("gone")
    assert torch_private.missing() == ["gone"]


def test_the_checks_find_what_they_look_for(tmp_path, monkeypatch):
    """The two AST checks below are not vacuous: a file with each kind of reach is caught."""
    package = tmp_path / "helpers"
    package.mkdir()
    bad = package / "bad.py"
    bad.write_text("import torch\nimport torch.distributed as dist\nfrom torch.utils._pytree import tree_flatten\n"
                   "from helpers.launcher.api import _start\nfrom .other import _thing\nfrom helpers import paths\n"
                   "n = torch.cuda._device_count_nvml()\ng = dist.distributed_c10d._world\nx = paths._secret\n"
                   "ok = torch.__version__\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    torch_uses = private_torch_uses(bad)
    assert len(torch_uses) == 3 and not any("__version__" in u for u in torch_uses), torch_uses
    project = private_project_imports(bad)
    assert [u.split(": ")[1] for u in project] == ["from helpers.launcher.api import _start",
                                                   "from helpers.other import _thing",
                                                   "paths._secret (helpers.paths)"], project


def test_a_notebook_is_read_cell_by_cell_as_a_kernel_runs_it(tmp_path):
    """Line magics do not hide a cell, a %%distributed cell's body (run on the ranks) is checked, a module imported in
    one cell is followed into the next, and markdown is prose."""
    cells = [("code", "import torch\n%load_ext helpers.launcher.workers\n"), ("code", "x = torch._C._x()\n"),
             ("code", "%%distributed\ny = torch.cuda._y\n"), ("markdown", "`torch._z`\n")]
    notebook = tmp_path / "n.ipynb"
    notebook.write_text(json.dumps({"cells": [{"cell_type": kind, "metadata": {}, "source": source.splitlines(True)}
                                              for kind, source in cells]}))
    assert private_torch_uses(notebook) == ["cell 1, line 1: torch._C._x", "cell 2, line 1: torch.cuda._y"]


@pytest.mark.parametrize("path", [p for p in SOURCES if p != HOME], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_but_torch_private_reaches_a_private_torch_name(path):
    assert not private_torch_uses(path), (f"{path.relative_to(ROOT)} uses private torch APIs; take them from "
                                          f"helpers/torch_private.py (with the reason): {private_torch_uses(path)}")


def _listed_for(path: Path) -> list[str]:
    """The private torch APIs torch_private allows `path` to name itself, in full."""
    return [f"{api.module}.{api.attribute}" for api in torch_private.PRIVATE.values()
            if str(path.relative_to(ROOT)) in api.named_in]


@pytest.mark.parametrize("path", ELSEWHERE, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_notebook_script_or_benchmark_names_only_the_private_torch_apis_listed_for_it(path):
    listed = _listed_for(path)
    unlisted = [f"{where}: {name}" for where, name in private_torch_names(path)
                if not any(name == api or name.startswith(api + ".") for api in listed)]
    assert not unlisted, (f"{path.relative_to(ROOT)} names private torch APIs that helpers/torch_private.py does not "
                          f"list for it (add the entry, its reason and this file to named_in): {unlisted}")


@pytest.mark.parametrize("name,where", [(name, where) for name, api in sorted(torch_private.PRIVATE.items())
                                        for where in api.named_in], ids="{0[0]}:{0[1]}".format)
def test_an_allowed_exception_is_used_where_it_is_listed(name, where):
    api = torch_private.PRIVATE[name]
    full = f"{api.module}.{api.attribute}"
    names = [n for _, n in private_torch_names(ROOT / where)]
    assert any(n == full or n.startswith(full + ".") for n in names), \
        f"{where} no longer names {full}: take it off {name}'s named_in in helpers/torch_private.py"


@pytest.mark.parametrize("path", SOURCES + ELSEWHERE, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_a_private_name_of_another_project_module(path):
    found = private_project_imports(path)
    assert not found, (f"{path.relative_to(ROOT)} imports private names of other modules of the project; give what "
                       f"is shared a public name: {found}")
