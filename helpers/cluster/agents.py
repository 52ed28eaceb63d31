"""Several torchrun agents ("nodes") on this one machine, started from a notebook cell and stopped with all they started.

Why not `run_torchrun`: that runs one `--standalone` agent to completion. A multi-node rendezvous needs several
agents alive at once, started at different times (a node that joins late), and some stopped on purpose (a node
that is lost). Each agent here leads a process session of its own and torchrun puts each of its workers in another,
so `kill` takes the agent's process tree (agent and workers, nothing else), and `stop_all` (also called on timeout
or interrupt) leaves no process behind. Output goes to a file per agent, read back whole, so two agents' lines never
interleave.
"""
from __future__ import annotations

import ast
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from helpers.cluster.torchrun import torchrun_path
from helpers.launcher.sessions import descendants, signal_session, stop_sessions
from helpers.paths import REPO_ROOT


@dataclass
class Agent:
    """One torchrun agent: its command, process and output file."""
    name: str
    command: list[str]
    proc: subprocess.Popen
    log: Path
    started: float = field(default_factory=time.monotonic)
    held: bool = False

    @property
    def output(self) -> str:
        return self.log.read_text(errors="backslashreplace") if self.log.exists() else ""

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def release(self) -> None:
        """Let a held agent go on into torchrun (it joins the rendezvous as soon as its imports are done)."""
        if not self.held:
            raise ValueError(f"agent {self.name} was not started held")
        self.held = False
        try:
            self.proc.stdin.write(b"go\n")
            self.proc.stdin.close()
        except (BrokenPipeError, ValueError):  # the agent is already gone: its exit status will say why
            pass

    def rendezvous(self) -> list[dict]:
        """What torchrun logged at each completed rendezvous (needs LOGLEVEL=INFO), in order: time, restart_count,
        group_rank, group_world_size, global_ranks, global_world_sizes, ..."""
        return rendezvous_results(self.output)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """A lost node: the agent and its workers die at once.

        The agent's session is not enough: torchrun starts each worker of a script in a session of its own
        (`start_new_session=True` in torch's SubprocessHandler), so a SIGKILL to the agent's session alone leaves
        its workers running, orphaned. They go on training with the other agents' workers and finish the job, and
        the surviving agents then wait in torchrun's exit barrier for the dead agent: 300 s, not a torchrun flag.
        So the agent is frozen (SIGSTOP: it cannot start a worker meanwhile), its process tree taken while it still
        roots it, and then the agent and the whole tree are signalled.
        """
        signal_session(self.proc.pid, signal.SIGSTOP)
        tree = descendants(self.proc.pid)
        signal_session(self.proc.pid, sig)
        for process in tree:
            try:
                process.send_signal(sig)
            except Exception:  # noqa: BLE001 - already gone
                pass
        signal_session(self.proc.pid, signal.SIGCONT)  # a frozen agent would not act on SIGTERM
        self.proc.wait()
        try:
            import psutil

            psutil.wait_procs(tree, timeout=10)
        except Exception:  # noqa: BLE001 - psutil missing
            pass


def start_agent(name: str, script, *script_args, log_dir, nnodes: str = "2", nproc: int = 2,
                endpoint: str = "127.0.0.1:29400", run_id: str = "cookbook", extra: tuple[str, ...] = (),
                env: dict | None = None, held: bool = False) -> Agent:
    """`torchrun --nnodes=N --nproc-per-node=P --rdzv-backend=c10d --rdzv-endpoint=E --rdzv-id=ID [extra] script`.

    No --node-rank: the c10d rendezvous assigns each agent its GROUP_RANK in the order the agents join.

    held: the agent's interpreter starts now and imports torch's launcher, then waits for `Agent.release()` before
    it runs torchrun's own `main` with the same arguments. Why: on a busy 2-core machine `import torch` takes from
    2 to 15 s, so "a node that joins at step 10" cannot be timed by starting a process at step 10; holding an
    interpreter that has done its imports makes the join follow the release within about a second.
    """
    command = [torchrun_path(), f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}", *extra, str(script), *map(str, script_args)]
    argv = [sys.executable, "-c", _HELD_TORCHRUN, *command[1:]] if held else command
    child_env = {**os.environ, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), child_env.get("PYTHONPATH", "")) if p)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    log = Path(log_dir) / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.PIPE if held else subprocess.DEVNULL, env=child_env,
                                start_new_session=True)
    return Agent(name, command, proc, log, held=held)


# torchrun's console script is `torch.distributed.run:main`; a held agent calls it itself once released. Its stdin
# closed without a release (the kernel died) ends it instead.
_HELD_TORCHRUN = ("import sys, torch.distributed.run as run\n"
                  "if sys.stdin.readline().strip() != 'go':\n"
                  "    sys.exit('held agent: stdin closed before its release')\n"
                  "run.main(sys.argv[1:])\n")

_LOG_LINE = re.compile(r"^[IWE](\d{4} \d\d:\d\d:\d\d\.\d+) \d+ \S+\] (.*)$")


def rendezvous_results(output: str) -> list[dict]:
    """Each "Rendezvous complete for workers. Result:" block of a torchrun log as a dict of its `key=value` lines
    (values parsed as Python literals where they are), with the log's time of day under "time"."""
    results, current = [], None
    for line in output.splitlines():
        match = _LOG_LINE.match(line)
        if match is None:
            continue
        stamp, text = match.groups()
        if "Rendezvous complete for workers" in text:
            current = {"time": stamp.split(" ")[1]}
            results.append(current)
        elif current is not None and re.fullmatch(r"\s+\w+=.*", text):
            key, value = text.strip().split("=", 1)
            try:
                current[key] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                current[key] = value
        else:
            current = None
    return results


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
    for agent in agents:
        if agent.proc.stdin is not None and not agent.proc.stdin.closed:  # a held agent never released
            agent.proc.stdin.close()


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


def wait_until(condition, agents: list[Agent], timeout: float, what: str, poll: float = 0.1) -> float:
    """Poll `condition()` until it holds while `agents` run; returns the seconds waited.

    Raises TimeoutError after `timeout`, or RuntimeError as soon as one of `agents` has exited first (the state
    waited for can no longer come), each with the agents' last lines. Stops nothing: the caller's `finally` calls
    `stop_all`."""
    start = time.monotonic()
    while not condition():
        gone = [a for a in agents if a.returncode is not None]
        waited = time.monotonic() - start
        if gone or waited > timeout:
            tails = "\n".join(f"--- {a.name} (exit {a.returncode}):\n" + "".join(a.output.splitlines(True)[-15:])
                              for a in agents)
            if gone:
                raise RuntimeError(f"waiting for {what}: agent {gone[0].name} exited with {gone[0].returncode}\n"
                                   f"{tails}")
            raise TimeoutError(f"waiting for {what}: not reached after {timeout:g} s\n{tails}")
        time.sleep(poll)
    return time.monotonic() - start


def processes_mentioning(marker: str) -> list:
    """The living processes whose command line contains `marker` (a run's output folder, say). An agent's workers
    leave its process tree when the agent dies, so "nothing left behind" is checked by what they were running."""
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        try:
            if process.pid != os.getpid() and process.info["status"] != psutil.STATUS_ZOMBIE and \
                    any(marker in part for part in process.info["cmdline"] or ()):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found
