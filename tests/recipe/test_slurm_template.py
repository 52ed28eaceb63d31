"""The SLURM templates run as 2-node jobs on this machine, with `srun` and `scontrol` stubbed: slurm/train.sbatch,
with the training recipe (its default SCRIPT) and with notebook 09's script (SCRIPT=scripts/cluster_ddp.py).

The stubs do what SLURM does for the template and no more: `scontrol show hostnames` expands the node list (here
two names for this machine), `srun` starts one copy of its command per task as a local process with SLURM_NODEID,
SLURM_PROCID, SLURM_LOCALID set, waits for all, and fails if one fails. Everything else (the rendezvous on the
first host, no --node-rank, the torchrun line) is the template's own, so a mistake in it fails here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.launcher.api import free_port
from helpers.cluster.torchrun import torchrun_path
from helpers.paths import REPO_ROOT

SLURM = REPO_ROOT / "slurm"
READMES = (REPO_ROOT / "README.md", REPO_ROOT / "scripts" / "train" / "README.md")

SRUN = r'''#!{python}
"""srun stub: one local process per task, each with its SLURM_* task variables."""
import os, subprocess, sys
args = sys.argv[1:]
ntasks = int(os.environ["SLURM_NNODES"])
while args and args[0].startswith("--"):
    if args[0].startswith("--ntasks="):
        ntasks = int(args[0].split("=", 1)[1])
    args = args[1:]
procs = [subprocess.Popen(args, env={{**os.environ, "SLURM_NODEID": str(i), "SLURM_PROCID": str(i),
                                      "SLURM_LOCALID": "0"}}) for i in range(ntasks)]
sys.exit(max(p.wait() for p in procs))
'''

SCONTROL = r'''#!{python}
"""scontrol stub: `scontrol show hostnames LIST` prints the comma-separated LIST one name a line."""
import sys
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
print("\n".join(sys.argv[3].split(",")))
'''


def run_template(template: Path, tmp_path: Path, script: Path, *flags: str) -> subprocess.CompletedProcess:
    """`bash TEMPLATE FLAGS...` as sbatch would run it in a 2-node allocation, one CPU process per node."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text.format(python=sys.executable))
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "SLURM_JOB_NODELIST": "127.0.0.1,localhost", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242",
           "NPROC_PER_NODE": "1", "TORCHRUN": torchrun_path(), "RDZV_PORT": str(free_port()),
           "SCRIPT": str(script), "OMP_NUM_THREADS": "1",
           # two "nodes" on one machine would each give their LOCAL_RANK 0 cuda:0: on a GPU machine NCCL refuses two
           # ranks on one GPU, so the simulated nodes run on CPU with gloo (notebook 09 and test_elastic do the same)
           "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(["bash", str(template), *flags], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600, stdin=subprocess.DEVNULL)  # a run: about 50 s on a loaded 2-core machine


def summary_of(run: subprocess.CompletedProcess) -> str:
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    summaries = [line for line in run.stdout.splitlines() if line.startswith("summary:")]
    assert len(summaries) == 1, output[-4000:]
    return summaries[0]


@pytest.mark.timeout(1800)  # two runs of the template: 96 s on a loaded 2-core machine
def test_the_recipe_template_runs_a_two_node_job_that_saves_on_sigterm_and_resumes(tmp_path: Path):
    # SIGTERM is what SLURM sends (--signal) before the time limit: here the last rank sends it to itself after
    # step 2 (the recipe's planted fault); the job must still end well, with step 2 committed, and the same
    # submission again must resume there and train to the end.
    recipe, ckpt = REPO_ROOT / "scripts" / "train" / "train.py", tmp_path / "ckpt"
    flags = ["--steps", "4", "--batch", "4", "--seq-len", "32", "--log-every", "1", "--eval-windows", "4",
             "--ckpt-dir", str(ckpt), "--save-every", "0", "--stop-check-every", "2"]
    stopped = json.loads(summary_of(run_template(SLURM / "train.sbatch", tmp_path, recipe, *flags, "--crash-at",
                                                 "2", "--crash-signal", "TERM")).removeprefix("summary:"))
    assert (stopped["world_size"], stopped["stopped"], stopped["step"]) == (2, True, 2), stopped
    assert int(Path(stopped["checkpoint"]).name.split("_")[-1]) == 2, stopped
    resumed = run_template(SLURM / "train.sbatch", tmp_path, recipe, *flags)
    finished = json.loads(summary_of(resumed).removeprefix("summary:"))
    assert (finished["world_size"], finished["stopped"], finished["step"]) == (2, False, 4), finished
    assert f"resumed from {stopped['checkpoint']}" in resumed.stdout, resumed.stdout[-3000:]


def test_the_template_runs_notebook_09s_script_as_a_two_node_job(tmp_path: Path):
    run = run_template(SLURM / "train.sbatch", tmp_path, REPO_ROOT / "scripts" / "cluster_ddp.py",
                       "--out", str(tmp_path / "out"), "--steps", "4", "--batch", "16", "--hidden", "8",
                       "--save-every", "2")
    assert "world=2" in summary_of(run)
    envs = sorted((tmp_path / "out" / "env").glob("attempt0_rank*.json"))
    assert len(envs) == 2, "one worker per node, two nodes"


def _shell_lines(text: str) -> list[str]:
    """The lines of a file's ```bash blocks (all of a shell script), comments dropped."""
    blocks = text.split("```")[1::2] if "```" in text else [text]
    lines = [line.split(" #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line and (not line.startswith("#") or line.startswith("#SBATCH"))]


def test_the_readmes_slurm_lines_say_and_do_what_the_template_does():
    """Under `set -o pipefail` `head -n 1` can fail a job (it may exit before scontrol has written the list), and
    torchrun kills its workers 30 s after passing SIGTERM on unless told otherwise: too little for the ranks to
    reach their next stop check and save. Every SLURM line the READMEs show either runs the template or does what it
    does: the first host with `sed -n 1p`, and a shutdown timeout that fits within the --signal lead."""
    template = _shell_lines((SLURM / "train.sbatch").read_text())
    for lines in [template] + [_shell_lines(readme.read_text()) for readme in READMES]:
        text = "\n".join(lines)
        assert "head -n" not in text and "head -1" not in text, text
        if "srun" not in text:
            continue
        lead = int(next(line for line in lines if "--signal=TERM@" in line).split("--signal=TERM@")[1].split()[0])
        timeout = next(line for line in lines if "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=" in line)
        seconds = int(timeout.split("=", 1)[1].replace("${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-", "").rstrip("}"))
        assert 30 < seconds < lead and "sed -n 1p" in text and "set -euo pipefail" in text, text
    assert "sbatch slurm/train.sbatch" in READMES[0].read_text(), "the cookbook's README runs the template"
