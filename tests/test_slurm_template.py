"""slurm/cluster_ddp.sbatch runs as a 2-node job on this machine, with `srun` and `scontrol` stubbed.

The stubs do what SLURM does for the template and no more: `scontrol show hostnames` expands the node list (here
two names for this machine), `srun` starts one copy of its command per task as a local process with SLURM_NODEID,
SLURM_PROCID, SLURM_LOCALID set, waits for all, and fails if one fails. Everything else (the rendezvous on the
first host, no --node-rank, the torchrun line) is the template's own, so a mistake in it fails here.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers.launcher.api import free_port
from helpers.launcher.torchrun import torchrun_path
from helpers.paths import REPO_ROOT

TEMPLATE = REPO_ROOT / "slurm" / "cluster_ddp.sbatch"

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


def test_the_sbatch_template_runs_a_two_node_job(tmp_path: Path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text.format(python=sys.executable))
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "SLURM_JOB_NODELIST": "127.0.0.1,localhost", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242",
           "NPROC_PER_NODE": "1", "TORCHRUN": torchrun_path(), "RDZV_PORT": str(free_port()),
           "SCRIPT": str(REPO_ROOT / "scripts" / "cluster_ddp.py"), "OMP_NUM_THREADS": "1",
           # two "nodes" on one machine would each give their LOCAL_RANK 0 cuda:0: on a GPU machine NCCL refuses two
           # ranks on one GPU, so the simulated nodes run on CPU with gloo (notebook 09 and test_elastic do the same)
           "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(["bash", str(TEMPLATE), "--out", str(tmp_path / "out"), "--steps", "4", "--batch", "16",
                          "--hidden", "8", "--save-every", "2"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    summaries = [line for line in run.stdout.splitlines() if line.startswith("summary:")]
    assert len(summaries) == 1 and "world=2" in summaries[0], output[-4000:]
    envs = sorted((tmp_path / "out" / "env").glob("attempt0_rank*.json"))
    assert len(envs) == 2, "one worker per node, two nodes"
