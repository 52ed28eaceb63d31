"""requirements.lock, ./cookbook and environment.yml describe one tested set of versions.

The lock is what a fresh clone installs (pip constraints); environment.yml is the conda route to the same set. A pin
that differs between them, or a dependency the lock leaves open, lets a new release change what one route installs.
"""
from __future__ import annotations

import re

import pytest

from helpers.paths import REPO_ROOT

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

LOCK = REPO_ROOT / "requirements.lock"


def _name(requirement: str) -> str:
    """PEP 503's normalised name of 'Name[extra]>=1' or 'Name==1'."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement.strip()).group(0)).lower()


def locked() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version and "+" not in version, f"requirements.lock: '{line}' is not an exact pin"
            pins[_name(name)] = version
    return pins


def conda_environment() -> tuple[dict[str, str], list[str]]:
    """environment.yml's conda pins (name -> version) and its pip lines."""
    pins, pip_lines = {}, []
    for line in (REPO_ROOT / "environment.yml").read_text().splitlines():
        item = re.match(r"\s+- (.+)$", line)
        if not item or item.group(1) in ("pip", "pip:", "conda-forge"):
            continue
        if line.startswith("      "):
            pip_lines.append(item.group(1))
        else:
            name, _, version = item.group(1).partition("=")
            pins[name] = version
    return pins, pip_lines


def test_the_lock_pins_every_dependency_the_project_names_but_torch_and_itself():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    extras = [r for requirements in project["optional-dependencies"].values() for r in requirements]
    # an extra may include another of the project's own (test includes distributed-cookbook-helpers[float8])
    named = {_name(r) for r in project["dependencies"] + extras} - {_name(project["name"])}
    pins = locked()
    assert "torch" not in pins and _name(project["name"]) not in pins, "TORCH_SPEC pins torch; the project is editable"
    assert sorted(named - {"torch"} - set(pins)) == []


def test_environment_yml_installs_the_tested_python_torch_and_lock():
    conda, pip_lines = conda_environment()
    tested_python = re.search(r"^# Passed: .*Python (\d+\.\d+)", LOCK.read_text(), re.M).group(1)
    torch_default = re.search(r"TORCH_SPEC:-torch==([\d.]+)", (REPO_ROOT / "cookbook").read_text()).group(1)
    assert conda["python"] == tested_python and conda["pytorch"] == torch_default
    assert pip_lines[0] == "-c requirements.lock", "pip installs into the conda environment at the lock's versions"
    others = {n: v for n, v in conda.items() if n not in ("python", "pytorch")}
    assert others == {n: locked().get(_name(n)) for n in others}, "any other conda pin is the lock's"
