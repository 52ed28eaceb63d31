"""'Take it to your project': a script from scripts/ run under torchrun from a notebook cell, and the lines to type.

(The scripts themselves are made of the notebooks' cells: `tools/export.py`.)

Running it: its output live in the cell, a timeout, nothing left behind.

Why not `!torchrun ...`: a shell escape cannot be given a timeout, loses the exit status in the notebook's logic,
and leaves the agent and its workers running when the cell is interrupted. Here torchrun runs in a session of its
own; on timeout or interrupt the whole session (agent and workers) is stopped. The torchrun used is the one next
to the kernel's interpreter, so the workers run the same torch as the notebook.
"""
from __future__ import annotations

import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from helpers.launcher.sessions import stop_sessions
from helpers.paths import REPO_ROOT


def torchrun_lines(script: str, nproc: str = "gpu", nodes: int = 2, endpoint: str = "HOST_OF_NODE_0:29500") -> str:
    """What to type on one machine, on each of several, and under SLURM, as text for the reader.

    With c10d rendezvous every node runs the same line and the rendezvous assigns the node ranks: no --node-rank
    (which belongs to the static rendezvous with --master-addr/--master-port, not to c10d)."""
    multi = (f"torchrun --nnodes={nodes} --nproc-per-node={nproc} --rdzv-backend=c10d "
             f"--rdzv-endpoint={endpoint} --rdzv-id=$JOB_ID {script}")
    return (f"# one machine, one process per GPU (or --nproc-per-node=N CPU processes):\n"
            f"torchrun --standalone --nproc-per-node={nproc} {script}\n\n"
            f"# {nodes} machines: the same line on every node; the c10d rendezvous numbers the nodes\n"
            f"{multi}\n\n"
            "# under SLURM: one task per node, the rendezvous on the job's first host (slurm/train.sbatch)\n"
            f"srun --nodes={nodes} --ntasks-per-node=1 " + multi.replace(
                endpoint, '$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p):29500').replace(
                "$JOB_ID", "$SLURM_JOB_ID") + "\n"
            "# (torchrun replaced `python -m torch.distributed.launch`, which older recipes use: it sets RANK and\n"
            "#  LOCAL_RANK in the environment instead of passing --local_rank, and restarts failed workers.)")


def torchrun_path() -> str:
    """The torchrun of this interpreter's environment (never one found first on PATH)."""
    beside = Path(sys.executable).with_name("torchrun")
    if beside.exists():
        return str(beside)
    found = shutil.which("torchrun")
    if found is None:
        raise FileNotFoundError("no torchrun next to sys.executable nor on PATH")
    return found


@dataclass
class TorchrunResult:
    returncode: int
    output: str
    command: list[str]
    seconds: float


def _stop_session(proc: subprocess.Popen) -> None:
    """torchrun's agent and its workers: the agent leads a session of its own."""
    def gone(pid: int, timeout: float) -> bool:
        try:
            proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    stop_sessions([proc.pid], gone, grace=5.0)


def run_torchrun(script: str | os.PathLike, *script_args: str, nproc: int = 2, max_restarts: int = 0,
                 log_dir: str | os.PathLike | None = None, extra: tuple[str, ...] = (), env: dict | None = None,
                 timeout: float = 300.0, echo: bool = True) -> TorchrunResult:
    """`torchrun --standalone --nproc-per-node N --max-restarts R [--log-dir D] script args`, streamed.

    The repository root is put on the workers' PYTHONPATH so a script may import `helpers`. Returns the exit
    status and the whole output; raises TimeoutError (after stopping everything) if it outlives `timeout`.
    """
    command = [torchrun_path(), "--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}"]
    if log_dir is not None:
        command.append(f"--log-dir={log_dir}")
    command += [*extra, str(script), *map(str, script_args)]
    child_env = {**os.environ, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), child_env.get("PYTHONPATH", "")) if p)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    start = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            text=True, errors="backslashreplace", env=child_env, start_new_session=True)
    lines: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    captured: list[str] = []
    try:
        while True:
            try:
                line = lines.get(timeout=0.1)
            except queue.Empty:
                line = ""
            if line is None:
                break
            if line:
                captured.append(line)
                if echo:
                    sys.stdout.write(line)
                    sys.stdout.flush()
            if time.monotonic() - start > timeout:
                _stop_session(proc)
                raise TimeoutError(f"torchrun outlived {timeout:g} s and was stopped; last output:\n"
                                   + "".join(captured[-20:]))
        proc.wait()
    except BaseException:
        _stop_session(proc)
        raise
    finally:
        reader.join(timeout=5)
    return TorchrunResult(proc.returncode, "".join(captured), command, time.monotonic() - start)


def error_files(log_dir: str | os.PathLike, attempt: int = 0) -> list:
    """The failures torchrun's `@record` wrote for one attempt, as `helpers.launcher.errors.RankFailure`s (rank =
    local rank).

    Why: torchrun picks its "root cause" from these files by earliest timestamp; reading them the same way as
    `helpers.launch` reports a failed launch lets a notebook compare its choice with `errors.root_cause`.
    """
    import json

    from helpers.launcher.errors import RankFailure

    failures = []
    for path in sorted(Path(log_dir).glob(f"*/attempt_{attempt}/*/error.json")):
        record = json.loads(path.read_text())["message"]
        failures.append(RankFailure(int(path.parent.name), record["message"].split(":")[0], record["message"],
                                    record["extraInfo"]["py_callstack"], float(record["extraInfo"]["timestamp"])))
    return failures
