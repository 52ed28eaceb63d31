"""The map at the launcher's door matches the code: every module it names imports, every name it gives exists, and
no module of the package is missing from it."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import helpers.launcher

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
