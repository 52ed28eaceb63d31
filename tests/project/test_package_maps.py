"""The maps at the packages' doors match the code: every module a map names imports, every name it gives exists, and
no module of the package is missing from its map. The launcher's map also says which process runs each module, and
no module imports one of a side it may not (the kernel's side never the rank's, nor the rank's the kernel's)."""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import helpers.launcher
import helpers.measure

# `module.name[.name...]` outside backticks (backticks quote a reader's code: `launch(fn, *args)`)
_REFERENCE = re.compile(r"(?<![\w.])([a-z_]+)\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")


def _modules(package) -> set[str]:
    return {p.stem for p in Path(package.__file__).parent.glob("*.py") if p.stem != "__init__"}


def _launcher_map_references() -> list[tuple[str, str]]:
    text = re.sub(r"`[^`]*`", "", helpers.launcher.__doc__)
    return _REFERENCE.findall(text)


@pytest.mark.parametrize("module,name", _launcher_map_references(),
                         ids=[f"{module}.{name}" for module, name in _launcher_map_references()])
def test_every_hop_on_the_launchers_map_exists(module, name):
    target = importlib.import_module(f"helpers.launcher.{module}")
    for part in name.split("."):
        target = getattr(target, part)


def test_the_launchers_map_names_every_module_of_the_package():
    assert {module for module, _ in _launcher_map_references()} == _modules(helpers.launcher)


# which sides' modules a module of each side may import: the fork-server's loop starts the rank that each fork becomes
MAY_IMPORT = {"kernel": {"kernel", "shared"}, "fork-server": {"fork-server", "rank", "shared"},
              "rank": {"rank", "shared"}, "shared": {"shared"}}


def launcher_sides() -> dict[str, str]:
    """module -> the side the launcher's map puts it on."""
    rows = re.findall(rf"^    ({'|'.join(MAY_IMPORT)}) {{2,}}([a-z_ ]+)$", helpers.launcher.__doc__, flags=re.M)
    sides = {}
    for side, modules in rows:
        for module in modules.split():
            assert module not in sides, f"{module} is on two sides of the launcher's map"
            sides[module] = side
    return sides


def launcher_imports(module: str) -> set[str]:
    """The launcher's modules that `module` imports, at its top or inside a function."""
    tree = ast.parse((Path(helpers.launcher.__file__).parent / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[2] for alias in node.names if alias.name.startswith("helpers.launcher.")}
        elif isinstance(node, ast.ImportFrom) and node.module == "helpers.launcher":
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("helpers.launcher."):
            found.add(node.module.split(".")[2])
    return found & _modules(helpers.launcher)


def test_the_launchers_map_puts_every_module_on_one_side():
    assert sorted(launcher_sides()) == sorted(_modules(helpers.launcher))


def test_no_launcher_module_imports_one_of_a_side_it_may_not():
    sides = launcher_sides()
    crossing = [f"{module} ({side}) imports {imported} ({sides[imported]})"
                for module, side in sorted(sides.items()) for imported in sorted(launcher_imports(module))
                if sides[imported] not in MAY_IMPORT[side]]
    assert not crossing, crossing


def test_the_measuring_modules_are_each_listed_with_their_purpose():
    listed = re.findall(r"^    ([a-z_]+) {2,}\S", helpers.measure.__doc__, flags=re.MULTILINE)
    assert sorted(listed) == sorted(_modules(helpers.measure)), "helpers/measure/__init__.py lists every module once"
    for module in listed:
        importlib.import_module(f"helpers.measure.{module}")
