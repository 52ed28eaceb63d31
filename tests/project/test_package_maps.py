"""The maps at the packages' doors match the code: every module a map names imports, every name it gives exists, and
no module of the package is missing from its map."""
from __future__ import annotations

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


def test_the_measuring_modules_are_each_listed_with_their_purpose():
    listed = re.findall(r"^    ([a-z_]+) {2,}\S", helpers.measure.__doc__, flags=re.MULTILINE)
    assert sorted(listed) == sorted(_modules(helpers.measure)), "helpers/measure/__init__.py lists every module once"
    for module in listed:
        importlib.import_module(f"helpers.measure.{module}")
