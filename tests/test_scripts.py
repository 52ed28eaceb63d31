"""The standalone scripts in scripts/: made of their notebooks' cells, free of `helpers`, and clean under torchrun.

Each script runs under `torchrun --standalone --nproc-per-node=2` from an empty directory where `import helpers`
fails, several times in a row with every core kept busy by other processes: a recipe that crashes at exit
("terminate called without an active exception") one run in three must not pass by luck.
"""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.export import drift
from helpers.launcher.torchrun import torchrun_path
from helpers.paths import SCRIPTS

# Small sizes for each script, as a reader would pass them for a first try. Every script needs an entry.
SMOKE_ARGS: dict[str, list[str]] = {
    "cluster_ddp.py": ["--steps", "6", "--batch", "16", "--hidden", "8", "--save-every", "3"],
    "hello_distributed.py": [],
}
RUNS = int(os.environ.get("COOKBOOK_SCRIPT_RUNS", "5"))
ALLOWED_THIRD_PARTY = {"torch", "numpy", "torchdata"}
RUN_TIMEOUT_S = 240


def _scripts() -> list[Path]:
    return sorted(SCRIPTS.glob("*.py")) if SCRIPTS.exists() else []


def test_every_script_is_made_of_its_notebooks_cells():
    assert drift() == []


@pytest.mark.parametrize("script", _scripts(), ids=lambda p: p.name)
def test_a_script_imports_only_torch_numpy_and_the_standard_library(script: Path):
    tree = ast.parse(script.read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    foreign = sorted(m for m in imported if m not in sys.stdlib_module_names and m not in ALLOWED_THIRD_PARTY)
    assert foreign == [], f"{script.name} imports {foreign}"


def test_every_script_has_smoke_arguments():
    assert sorted(p.name for p in _scripts()) == sorted(SMOKE_ARGS)


class _BusyCores:
    """One spinning process per core for the duration of a block, stopped and reaped afterwards."""

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


@pytest.mark.parametrize("name", sorted(SMOKE_ARGS))
def test_a_script_runs_cleanly_under_torchrun_without_helpers_every_time(name: str, tmp_path: Path):
    shutil.copy(SCRIPTS / name, tmp_path / name)
    blocker = tmp_path / "no_helpers"
    blocker.mkdir()
    (blocker / "helpers.py").write_text("raise ImportError('a standalone script must not import helpers')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COOKBOOK_", "PYTHON"))}
    env["PYTHONPATH"] = str(blocker)  # ahead of site-packages, where the editable install would find helpers
    command = [torchrun_path(), "--standalone", "--nproc-per-node=2", name, *SMOKE_ARGS[name]]
    with _BusyCores():
        for attempt in range(1, RUNS + 1):
            run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                                 timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL)
            output = run.stdout + run.stderr
            assert run.returncode == 0, f"run {attempt}/{RUNS} of {name} failed:\n{output[-4000:]}"
            assert "terminate called" not in output, f"run {attempt}/{RUNS} of {name} aborted at exit:\n{output}"
            summaries = [line for line in run.stdout.splitlines() if line.startswith("summary:")]
            assert len(summaries) == 1, f"run {attempt}/{RUNS}: want one 'summary:' line, got:\n{run.stdout}"
