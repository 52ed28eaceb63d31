"""Private names stay private: torch's have one home (helpers/torch_private.py), the project's own stay in their module.

A private torch API may vanish in any release: each one the helpers use is resolved here, and a removed one fails
a test that names it and its users. A module that imports another project module's `_private` name (or reaches it
as `module._name`) couples the two through something the other never promised; each file is its own test, so a
failure names the file."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers import torch_private

ROOT = Path(__file__).resolve().parents[1]
PROJECT_PACKAGES = ("helpers", "tools")
SOURCES = sorted(p for package in PROJECT_PACKAGES if (ROOT / package).is_dir()
                 for p in (ROOT / package).rglob("*.py"))
HOME = ROOT / "helpers" / "torch_private.py"


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


def private_torch_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch" and not node.level:
            parts = node.module.split(".") + [a.name for a in node.names]
            if any(_private(p) for p in parts):
                found.append(f"line {node.lineno}: from {node.module} import "
                             f"{', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] == "torch" and any(_private(p) for p in a.name.split("."))]
    torch_names = _aliases(tree, path, ("torch",))
    _mark_parents(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None), ast.Attribute):
            root, attrs = _chain(node)
            if root in torch_names and any(_private(a) for a in attrs):
                found.append(f"line {node.lineno}: {root}.{'.'.join(attrs)}")
    return sorted(set(found))


def private_project_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    here = _module_of(path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = _absolute(node, path)
            if module.split(".")[0] in PROJECT_PACKAGES and module != here:
                found += [f"line {node.lineno}: from {module} import {a.name}" for a in node.names if _private(a.name)]
    modules = _aliases(tree, path, PROJECT_PACKAGES)
    _mark_parents(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None), ast.Attribute):
            root, attrs = _chain(node)
            if root in modules and modules[root] != here and any(_private(a) for a in attrs):
                found.append(f"line {node.lineno}: {root}.{'.'.join(attrs)} ({modules[root]})")
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


@pytest.mark.parametrize("path", [p for p in SOURCES if p != HOME], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_but_torch_private_reaches_a_private_torch_name(path):
    assert not private_torch_uses(path), (f"{path.relative_to(ROOT)} uses private torch APIs; take them from "
                                          f"helpers/torch_private.py (with the reason): {private_torch_uses(path)}")


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_a_private_name_of_another_project_module(path):
    found = private_project_imports(path)
    assert not found, (f"{path.relative_to(ROOT)} imports private names of other modules of the project; give what "
                       f"is shared a public name: {found}")
