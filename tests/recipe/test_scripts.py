"""The standalone scripts in scripts/: made of their notebooks' cells, free of `helpers`, and clean under torchrun.

Each script runs under `torchrun --standalone --nproc-per-node=2` from an empty directory where `import helpers`
fails, RUNS times at once so that every core is busy (2 runs of 2 ranks: twice as many processes as this machine's
cores): a recipe that crashes at exit ("terminate called without an active exception") one run in two fails here
3 times in 4; `COOKBOOK_SCRIPT_RUNS=10` runs more when chasing such a crash.
"""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools.export import drift
from helpers.cluster.torchrun import torchrun_path
from helpers.devices import gpu_count
from helpers.paths import REPO_ROOT, SCRIPTS

# Small sizes for each script, as a reader would pass them for a first try. Every script needs an entry.
SMOKE_ARGS: dict[str, list[str]] = {
    "cluster_ddp.py": ["--steps", "6", "--batch", "16", "--hidden", "8", "--save-every", "3"],
    "collectives.py": ["--elements-per-rank", "1000"],
    "ddp_bench.py": ["--caps", "1", "25", "--hidden", "64", "--depth", "2", "--batch-size", "8", "--repeats", "3",
                     "--data", str(REPO_ROOT / "data" / "digits.npz")],
    "hello_distributed.py": [],
    "rpc_parameter_server.py": ["--steps", "10", "--hidden", "32", "--depth", "1", "--samples", "500"],
    "train_ddp.py": ["--epochs", "1", "--hidden", "64", "--depth", "2", "--checkpoint", "digits_mlp.pt",
                     "--data", str(REPO_ROOT / "data" / "digits.npz")],  # the copy alone: told where the data is
}
RUNS = int(os.environ.get("COOKBOOK_SCRIPT_RUNS", "2"))  # 2 x 2 ranks: twice as many processes as this machine's cores
ALLOWED_THIRD_PARTY = {"torch", "numpy", "torchdata"}
RUN_TIMEOUT_S = 600  # the slowest script's runs: 53 s on a loaded 2-core machine


def _scripts() -> list[Path]:
    return sorted(SCRIPTS.glob("*.py")) if SCRIPTS.exists() else []


def _sibling_imports(name: str) -> list[str]:
    """The files of scripts/ that script `name` needs beside it (it must be copied with them), followed through what
    they import in turn: a script beside it, or a module of the recipe in train/ (train_ddp.py puts train/ on its
    path for distributed.py, cluster_ddp.py for checkpoint.py)."""
    needed, todo = set(), [name]
    while todo:
        tree = ast.parse((SCRIPTS / todo.pop()).read_text())
        modules = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        modules |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        found = {f"{folder}{m}.py" for m in modules for folder in ("", "train/") if (SCRIPTS / f"{folder}{m}.py").exists()}
        todo += sorted(found - needed - {name})
        needed |= found
    return sorted(needed - {name})


def test_every_script_is_made_of_its_notebooks_cells():
    assert drift() == []


@pytest.mark.parametrize("script", _scripts(), ids=lambda p: p.name)
def test_a_script_imports_only_torch_numpy_and_the_standard_library(script: Path):
    tree = ast.parse(script.read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    # a script may import another one, or a module of the recipe (cluster_ddp.py: the commit protocol of checkpoint.py)
    siblings = {p.stem for p in _scripts()} | {p.stem for p in (SCRIPTS / "train").glob("*.py")}
    foreign = sorted(m for m in imported
                     if m not in sys.stdlib_module_names and m not in ALLOWED_THIRD_PARTY and m not in siblings)
    assert foreign == [], f"{script.name} imports {foreign}"


def test_every_script_has_smoke_arguments():
    assert sorted(p.name for p in _scripts()) == sorted(SMOKE_ARGS)


@pytest.mark.parametrize("name", sorted(SMOKE_ARGS))
def test_a_script_runs_cleanly_under_torchrun_without_helpers_every_time(name: str, tmp_path: Path):
    """RUNS torchrun jobs of the script at once, each in a directory of its own: the cores are busy with each
    other's ranks (2 x RUNS processes on this machine's few cores), which is when an exit crash shows."""
    blocker = tmp_path / "no_helpers"
    blocker.mkdir()
    (blocker / "helpers.py").write_text("raise ImportError('a standalone script must not import helpers')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COOKBOOK_", "PYTHON"))}
    env["PYTHONPATH"] = str(blocker)  # ahead of site-packages, where the editable install would find helpers
    if gpu_count() == 1:
        env["CUDA_VISIBLE_DEVICES"] = ""  # 2 ranks, 1 GPU: the recipe refuses to share it; on the CPU, as it advises
    command = [torchrun_path(), "--standalone", "--nproc-per-node=2", name, *SMOKE_ARGS[name]]
    runs = []
    for attempt in range(1, RUNS + 1):
        workdir = tmp_path / f"run{attempt}"
        workdir.mkdir()
        for needed in (name, *_sibling_imports(name)):  # the script and the scripts it imports, nothing else
            (workdir / needed).parent.mkdir(exist_ok=True)
            shutil.copy(SCRIPTS / needed, workdir / needed)
        runs.append(subprocess.Popen(command, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, stdin=subprocess.DEVNULL, start_new_session=True))
    try:
        outputs = [run.communicate(timeout=RUN_TIMEOUT_S) for run in runs]
    finally:
        for run in runs:
            if run.poll() is None:
                os.killpg(run.pid, 9)
                run.wait()
    for attempt, (run, (stdout, stderr)) in enumerate(zip(runs, outputs), start=1):
        output = stdout + stderr
        assert run.returncode == 0, f"run {attempt}/{RUNS} of {name} failed:\n{output[-4000:]}"
        assert "terminate called" not in output, f"run {attempt}/{RUNS} of {name} aborted at exit:\n{output}"
        summaries = [line for line in stdout.splitlines() if line.startswith("summary:")]
        assert len(summaries) == 1, f"run {attempt}/{RUNS}: want one 'summary:' line, got:\n{stdout}"


def _flags(script: Path) -> set[str]:
    """The options a script's argparse defines: every `add_argument("--name", ...)` (read, not run: starting each
    script only to print --help cost a torch import apiece, over a minute in all on two cores), and where it makes a
    command line from the recipe's table of flags (`parser("train", ...)`: train.py, plan.py), that command's
    rows of the table (job.py, torch-free: imported)."""
    calls = [node for node in ast.walk(ast.parse(script.read_text())) if isinstance(node, ast.Call)]
    flags = {"--help"} | {arg.value for call in calls if isinstance(call.func, ast.Attribute)
                          and call.func.attr == "add_argument" for arg in call.args
                          if isinstance(arg, ast.Constant) and str(arg.value).startswith("--")}
    made = {call.args[0].value for call in calls if isinstance(call.func, ast.Name) and call.func.id == "parser"
            and call.args and isinstance(call.args[0], ast.Constant)}
    if made:
        sys.path.insert(0, str(script.parent))
        try:
            import job
        finally:
            sys.path.remove(str(script.parent))
        flags |= {"--" + f.name.replace("_", "-") for f in job.FLAGS if set(f.commands) & made}
    return flags


def test_the_command_lines_the_notebooks_show_name_only_flags_their_script_has():
    """A reader pastes these lines: a flag the script does not define fails at once (06 once showed --run-dir)."""
    import json
    import re

    from helpers.paths import NOTEBOOKS

    names = {p.name for p in _scripts()} | {f"train/{p.name}" for p in (SCRIPTS / "train").glob("*.py")}
    flags: dict[str, set[str]] = {}
    unknown = []
    for notebook in sorted(NOTEBOOKS.glob("[0-9]*.ipynb")):
        for cell in json.loads(notebook.read_text())["cells"]:
            for line in "".join(cell["source"]).splitlines():
                shown = re.search(r"((?:train/)?\w+\.py)((?:\s+--[\w-]+(?:[= ][^\s-]\S*)?)+)", line)
                if not shown or shown.group(1) not in names:
                    continue
                script = shown.group(1)
                flags.setdefault(script, _flags(SCRIPTS / script))
                unknown += [f"{notebook.name} {cell['id']}: {script} {flag}"
                            for flag in re.findall(r"--[\w-]+", shown.group(2)) if flag not in flags[script]]
    assert flags, "the notebooks show torchrun lines for their scripts"
    assert unknown == []


def test_the_flags_are_read_as_argparse_would_define_them(tmp_path: Path):
    """`_flags` reads what `--help` would list: checked on one script against its real --help."""
    script = SCRIPTS / "train_ddp.py"
    shown = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120,
                           cwd=tmp_path).stdout
    listed = set(re.findall(r"^  (?:-\w, )?(--[\w-]+)", shown, re.M))  # argparse's option lines
    assert _flags(script) == listed and len(listed) > 3


def _planted_notebook(path: Path, *tagged: tuple[str, str]) -> None:
    import json

    cells = [{"cell_type": "code", "id": f"c{i}", "metadata": {"tags": [tag]}, "outputs": [], "execution_count": None,
              "source": source} for i, (tag, source) in enumerate(tagged)]
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))


def test_a_recipe_module_is_made_of_several_notebooks_cells_in_notebook_order(tmp_path: Path):
    from tools.export import exported_scripts

    _planted_notebook(tmp_path / "03_a.ipynb", ("script:train/par.py", '"""Doc."""\nimport torch\n\n\ndef a():\n    pass'))
    _planted_notebook(tmp_path / "07_b.ipynb", ("script:train/par.py", "def b():\n    pass"),
                      ("script:train/cli.py", "def main():\n    pass"))
    scripts = exported_scripts(tmp_path)
    par = scripts["train/par.py"]
    assert par.index("03_a.ipynb") < par.index("07_b.ipynb") < par.index('"""Doc."""') < par.index("def a") < par.index("def b")
    assert "__main__" not in par, "an imported module without main() gets no __main__ block"
    assert scripts["train/cli.py"].rstrip().endswith("main()"), "a module that defines main() runs it as a script"


@pytest.mark.parametrize("tag", ["script:other/x.py", "script:train/x.txt", "script:train/sub/x.py"])
def test_a_tag_outside_scripts_and_its_recipe_folder_is_refused(tmp_path: Path, tag: str):
    from tools.export import exported_scripts

    _planted_notebook(tmp_path / "01_a.ipynb", (tag, "def main():\n    pass"))
    with pytest.raises(ValueError, match="must name a file"):
        exported_scripts(tmp_path)
