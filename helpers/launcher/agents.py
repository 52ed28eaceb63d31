"""Several torchrun agents ("nodes") on this one machine, started from a notebook cell and stopped with all they started.

Why not `run_torchrun`: that runs one `--standalone` agent to completion. A multi-node rendezvous needs several
agents alive at once, started at different times (a node that joins late), and some stopped on purpose (a node
that is lost). Each agent here leads a process session of its own, so `kill` reaches the agent and its workers and
nothing else, and `stop_all` (also called on timeout or interrupt) leaves no process behind. Output goes to a file
per agent, read back whole, so two agents' lines never interleave.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from helpers.launcher.sessions import stop_sessions
from helpers.launcher.torchrun import torchrun_path
from helpers.paths import REPO_ROOT


@dataclass
class Agent:
    """One torchrun agent: its command, process and output file."""
    name: str
    command: list[str]
    proc: subprocess.Popen
    log: Path
    started: float = field(default_factory=time.monotonic)

    @property
    def output(self) -> str:
        return self.log.read_text(errors="backslashreplace") if self.log.exists() else ""

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """A lost node: the agent and its workers die at once (SIGKILL to the whole session)."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        self.proc.wait()


def start_agent(name: str, script, *script_args, log_dir, nnodes: str = "2", nproc: int = 2,
                endpoint: str = "127.0.0.1:29400", run_id: str = "cookbook", extra: tuple[str, ...] = (),
                env: dict | None = None) -> Agent:
    """`torchrun --nnodes=N --nproc-per-node=P --rdzv-backend=c10d --rdzv-endpoint=E --rdzv-id=ID [extra] script`.

    No --node-rank: the c10d rendezvous assigns each agent its GROUP_RANK in the order the agents join.
    """
    command = [torchrun_path(), f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}", *extra, str(script), *map(str, script_args)]
    child_env = {**os.environ, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), child_env.get("PYTHONPATH", "")) if p)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    log = Path(log_dir) / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=child_env, start_new_session=True)
    return Agent(name, command, proc, log)


def wait_listening(port: int, host: str = "127.0.0.1", timeout: float = 60.0) -> None:
    """Block until something accepts connections on host:port (the c10d store of the first agent)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout:g} s")


def stop_all(agents: list[Agent], grace: float = 5.0) -> None:
    """SIGTERM every agent's session, then SIGKILL what is left; every agent reaped."""
    def gone(pid: int, timeout: float) -> bool:
        proc = next(a.proc for a in agents if a.proc.pid == pid)
        try:
            proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    stop_sessions([a.proc.pid for a in agents], gone, grace=grace)


def wait_all(agents: list[Agent], timeout: float) -> list[int]:
    """Every agent's exit status; on timeout (or an interrupt) all are stopped and TimeoutError names the living."""
    deadline = time.monotonic() + timeout
    try:
        for agent in agents:
            agent.proc.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        alive = [a.name for a in agents if a.proc.poll() is None]
        stop_all(agents)
        tails = "\n".join(f"--- {a.name}:\n" + "".join(a.output.splitlines(True)[-15:]) for a in agents)
        raise TimeoutError(f"agents {alive} outlived {timeout:g} s and were stopped\n{tails}") from None
    except BaseException:
        stop_all(agents)
        raise
    return [a.proc.returncode for a in agents]
