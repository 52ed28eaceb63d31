"""Run a script under torchrun from a notebook cell: its output live in the cell, a timeout, nothing left behind.

Why not `!torchrun ...`: a shell escape cannot be given a timeout, loses the exit status in the notebook's logic,
and leaves the agent and its workers running when the cell is interrupted. Here torchrun runs in a session of its
own; on timeout or interrupt the whole session (agent and workers) is stopped. The torchrun used is the one next
to the kernel's interpreter, so the workers run the same torch as the notebook.
"""
from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


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
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), child_env.get("PYTHONPATH", "")) if p)
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
