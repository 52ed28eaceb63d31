"""A plain install ships every module: a wheel built from this checkout, installed (not editable) into a fresh virtual
environment, imports each module of helpers and tools from that environment.

Why: an editable install finds whatever the checkout holds, so a package that pyproject.toml leaves out goes unnoticed
until someone runs `pip install .`. Cheap and offline: the new environment sees the running one's packages (torch and
the rest), and the wheel is built without build isolation, so pip fetches nothing. The modules to import are listed
from the checkout's files, not from what was installed, so a module the wheel lacks is a failure, not a gap.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import venv
from pathlib import Path

from helpers.paths import REPO_ROOT

PACKAGES = ("helpers", "tools")
# What a build must not see: git's and the environments' folders, build outputs, executed notebooks
NOT_COPIED = shutil.ignore_patterns(".*", "__pycache__", "*.egg-info", "build", "dist", "outputs")
PIP_TIMEOUT_S = 600  # a build and an install take seconds; a loaded machine gets a hundredfold

IMPORT_EACH = """
import importlib, json, sys, traceback
found = {}
for name in sys.argv[1:]:
    try:
        found[name] = {"file": importlib.import_module(name).__file__}
    except BaseException:
        found[name] = {"error": traceback.format_exc(limit=3)}
print(json.dumps(found))
"""


def checkout_modules() -> list[str]:
    """Every module of the packages, by the checkout's .py files."""
    modules = []
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            modules.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return modules


def _run(command: list, cwd: Path) -> str:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    assert done.returncode == 0, f"{' '.join(map(str, command))} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _reaches_no_checkout(entry: str) -> bool:
    """A sys.path folder from which neither this checkout's packages nor another copy of them can be imported."""
    path = Path(entry or ".").resolve()
    return path.is_dir() and not any((path / package).is_dir() for package in PACKAGES)


def test_a_wheel_installed_into_a_fresh_environment_imports_every_module(tmp_path):
    source, wheels, env = tmp_path / "source", tmp_path / "wheels", tmp_path / "env"
    shutil.copytree(REPO_ROOT, source, ignore=NOT_COPIED)  # a build writes build/ and *.egg-info beside its source
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", wheels, source], tmp_path)
    venv.create(env, system_site_packages=True, with_pip=False)
    python = env / "bin" / "python"
    site_packages = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              tmp_path).strip())
    # the running environment's packages after the new one's own (a venv's --system-site-packages reaches only the
    # interpreter it was made from, not the venv this test may run in); never the checkout, which pytest puts first
    (site_packages / "running-environment.pth").write_text(
        "".join(entry + "\n" for entry in sys.path if _reaches_no_checkout(entry)))
    (wheel,) = wheels.glob("*.whl")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
          "--ignore-installed", "-q", wheel], tmp_path)

    modules = checkout_modules()
    # -I: neither PYTHONPATH nor the working folder (outside the checkout as well) can bring the checkout's copy in
    found = json.loads(_run([python, "-I", "-c", IMPORT_EACH, *modules], tmp_path))
    failed = {name: record["error"] for name, record in found.items() if "error" in record}
    assert not failed, "modules the installed wheel cannot import:\n" + "\n".join(
        f"{name}:\n{error}" for name, error in failed.items())
    inside = site_packages.resolve()
    elsewhere = {name: record["file"] for name, record in found.items()
                 if inside not in Path(record["file"]).resolve().parents}
    assert not elsewhere, f"imported from outside the new environment's {inside}: {elsewhere}"
