"""The fork-server: a clean interpreter with torch imported that forks workers on request.

Why: forking the Jupyter kernel itself is unsafe once the kernel has started threads (autograd's, OpenMP's,
CUDA's, Jupyter's own): on a GPU machine a forked worker's CUDA then fails with "initialization error" although
`torch.cuda.is_initialized()` says False, and no flag tells beforehand. Spawning a fresh interpreter per worker is
safe but pays `import torch` every launch (3.55 s per launch on an H100 machine, against 0.06 s for a fork). So the
kernel starts, once, a server process that imports torch and the rank's module, runs no torch op, never touches
CUDA and holds exactly one thread; every launch asks it to fork `world_size` workers, which therefore start as
copies of a process that is safe to fork, in milliseconds.

Why an own server over a socketpair rather than `multiprocessing`'s forkserver with a preload list: we need (1)
the workers' pipes handed over with the request (SCM_RIGHTS), so output streams live into the cell; (2) the exit
status of each worker (the server is their parent and the only process that can reap them), sent back as a
message, so the kernel's supervisor wakes on an exit instead of polling; (3) the server to notice the kernel's
death without threads and take every worker with it; (4) OpenBLAS pinned to one thread before numpy is imported,
so the server really holds one thread (`/proc/<pid>/task`); (5) a stale server (torch reinstalled, interpreter
changed, a variable torch reads at import changed) replaced, not reused. multiprocessing's forkserver gives none
of these through public API. The messages (`protocol`: Fork one way; Ready, Forked, Exited the other) travel over
an AF_UNIX SOCK_SEQPACKET pair (message boundaries kept, file descriptors attached to a message).

This module is the kernel's handle on the server; the server's own loop, which forks and so imports the rank's
side, is `server_loop`, started by a `python -c` boot that no import follows.

The server never unpickles a payload: a worker reads its function and arguments from the run folder after
the fork, so nothing a notebook defines is ever imported into the server.

Lifetime: started at the first launch (or `start_server()`), it lives as long as the kernel. When the kernel dies
(a restart is a SIGKILL, so no `finally` runs) its end of the socket closes; the server wakes on that, kills every
worker's session and exits. Each worker also asks to be killed when the server dies (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import atexit
import importlib.util
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from helpers.launcher import sessions
from helpers.launcher.protocol import MESSAGE_BYTES, SERVER_REPLIES, Exited, Fork, Forked, Ready, decode, encode

# numpy's OpenBLAS starts its thread pool when numpy is imported, unless told to stay at one thread.
SERVER_ONLY_ENV = {"OPENBLAS_NUM_THREADS": "1"}
# Variables torch (or its OpenMP/MKL runtime) reads when it is imported: a server that imported torch under other
# values would give the workers a torch that ignores the kernel's current ones, so it is replaced. Variables read
# later (at init_process_group, at the first CUDA call) need no restart; TORCH_DISTRIBUTED_DEBUG is read at import
# but re-applied in each worker (`dist.set_debug_level_from_env`), and OMP_NUM_THREADS is applied per worker.
IMPORT_TIME_PREFIXES = ("TORCH_", "PYTORCH_", "OMP_", "KMP_", "GOMP_", "MKL_", "LD_PRELOAD", "LD_LIBRARY_PATH")
READ_LATER = ("TORCH_DISTRIBUTED_DEBUG", "TORCH_NCCL_", "TORCH_FR_", "TORCHELASTIC_", "OMP_NUM_THREADS")
# The launcher's modules the server and a forked worker run from the server's memory: one changed on disk, server
# replaced.
WORKER_MODULES = ("server_loop.py", "rank.py", "protocol.py", "run_folder.py", "errors.py", "rendezvous.py",
                  "sessions.py")
READY_TIMEOUT_S = 900.0  # importing torch took up to 45 s on a 2-core machine at a load of 16: 20x that; a dead
#                         server ends the wait at once (its socket closes), so only a hung one waits this long


def import_time_environment(env: dict) -> dict:
    """The part of `env` that a server must have been started with for its torch to match."""
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES) and not k.startswith(READ_LATER)}


def installation_fingerprint() -> dict:
    """What identifies the interpreter, torch and launcher code a server runs: changed on disk, server replaced."""
    def stamp(path):
        try:
            st = os.stat(path)
            return (str(path), st.st_mtime_ns, st.st_size)
        except OSError:
            return (str(path), None, None)

    spec = importlib.util.find_spec("torch")
    torch_dir = Path(spec.origin).parent if spec and spec.origin else None
    here = Path(__file__).resolve().parent
    return {"python": os.path.realpath(sys.executable),
            "torch": stamp(torch_dir / "version.py") if torch_dir else None,
            "launcher": [stamp(here / name) for name in WORKER_MODULES]}


class ForkServer:
    """The kernel's handle on one server process: start it, ask it for workers, hear when they exit."""

    def __init__(self, env: dict | None = None):
        env = dict(os.environ if env is None else env)
        self.import_env = import_time_environment(env)
        self.fingerprint = installation_fingerprint()
        self.exits: dict[int, int] = {}  # worker pid -> exit code (negative: killed by that signal)
        self._lock = threading.Lock()
        self._ready = False
        self._log = tempfile.NamedTemporaryFile(prefix="cookbook-forkserver-", suffix=".log", delete=False)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        helpers_root = str(Path(__file__).resolve().parents[2])
        boot = (f"import sys; sys.path.insert(0, {helpers_root!r}); "
                f"from helpers.launcher.server_loop import serve; serve({theirs.fileno()})")
        self.process = subprocess.Popen([sys.executable, "-c", boot], pass_fds=(theirs.fileno(),),
                                        env={**env, **SERVER_ONLY_ENV}, stdin=subprocess.DEVNULL,
                                        stdout=self._log, stderr=self._log, start_new_session=True)
        theirs.close()
        self.sock, self.pid = ours, self.process.pid

    # -- lifecycle
    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        if self._ready:
            return
        reply = self._receive(timeout)
        if not isinstance(reply, Ready):
            self.stop()
            raise RuntimeError(f"the launcher's fork-server did not start (exit code {self.process.poll()}); "
                               f"its output:\n{self.log_text()}")
        self.threads_at_ready = reply.threads
        self._ready = True

    def alive(self) -> bool:
        return self.process.poll() is None

    def matches(self, env: dict) -> bool:
        """Still the server for a launch with this environment: alive, same installation, same import-time vars."""
        return (self.alive() and self.fingerprint == installation_fingerprint()
                and self.import_env == import_time_environment(env))

    def stop(self) -> None:
        """Close our end: the server kills its workers and exits; reaped here."""
        try:
            self.sock.close()
        except OSError:
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.pid, signal.SIGKILL)
            self.process.wait()
        self._log.close()
        try:
            os.unlink(self._log.name)
        except OSError:
            pass

    def log_text(self) -> str:
        try:
            return Path(self._log.name).read_text(errors="backslashreplace")[-4000:]
        except OSError:
            return "(no output)"

    # -- workers
    def fork(self, run_dir: str, fds_by_rank: dict[int, list[int]]) -> dict[int, int]:
        """A worker for each rank, with its fds as stdout, stderr, progress pipe (and, for persistent workers, the
        command pipe); returns rank -> pid.

        All requests go out before the first reply is read, so the server forks them back to back."""
        self.wait_ready()
        pids: dict[int, int] = {}
        with self._lock:
            for rank, fds in fds_by_rank.items():
                socket.send_fds(self.sock, [encode(Fork(run_dir, rank))], fds)
            while len(pids) < len(fds_by_rank):
                reply = self._receive_locked(READY_TIMEOUT_S)
                if reply is None:
                    raise RuntimeError(f"the launcher's fork-server died while starting ranks "
                                       f"{sorted(set(fds_by_rank) - set(pids))}:\n{self.log_text()}")
                if isinstance(reply, Forked) and reply.run_dir == run_dir:
                    pids[reply.rank] = reply.pid
        return pids

    def fileno(self) -> int:
        """Readable when the server has news (a worker exited): for the supervisor's selector."""
        return self.sock.fileno()

    def poll(self) -> None:
        """Take in every message already waiting, without blocking."""
        with self._lock:
            while self._receive_locked(0.0) is not None:
                pass

    def exitcode(self, pid: int) -> int | None:
        return self.exits.get(pid)

    def wait_exit(self, pid: int, timeout: float) -> bool:
        """Whether worker `pid` has exited (and been reaped by the server) within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while pid not in self.exits:
            remaining = deadline - time.monotonic()
            if remaining < 0 or not self.alive():
                return pid in self.exits or not self.alive()
            with self._lock:
                self._receive_locked(remaining)
        return True

    def _receive(self, timeout: float):
        with self._lock:
            return self._receive_locked(timeout)

    def _receive_locked(self, timeout: float):
        """One message (filing exit notices as they pass), or None on timeout or a closed server."""
        try:
            ready, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
        except (OSError, ValueError):
            return None
        if not ready:
            return None
        try:
            data = self.sock.recv(MESSAGE_BYTES)
        except OSError:
            return None
        if not data:
            return None
        message = decode(data, SERVER_REPLIES)
        if isinstance(message, Exited):
            self.exits[message.pid] = message.exitcode
        return message


class ServerWorker:
    """A worker the server forked: the supervisor's handle (exit notices come as the server's messages)."""

    def __init__(self, server: ForkServer, pid: int):
        self.server, self.pid = server, pid

    def exit_fd(self) -> int | None:
        return self.server.fileno() if self.server.alive() else None

    def poll(self) -> None:
        self.server.poll()

    def exitcode(self) -> int | None:
        code = self.server.exitcode(self.pid)
        if code is None and not self.server.alive():  # its PDEATHSIG killed it with the server
            return -signal.SIGKILL
        return code

    def wait_gone(self, timeout: float) -> bool:
        return self.server.wait_exit(self.pid, timeout)

    def close(self) -> None:
        self.server.exits.pop(self.pid, None)


_server: ForkServer | None = None
_server_lock = threading.Lock()


def server_for(env: dict) -> ForkServer:
    """The running server if it suits a launch with environment `env`, else a new one (the old one stopped)."""
    global _server
    with _server_lock:
        if _server is not None and not _server.matches(env):
            _server.stop()
            _server = None
        if _server is None:
            _server = ForkServer(env)
        return _server


def start_server() -> ForkServer:
    """Start the server now (it imports torch in the background) so that the first launch does not wait."""
    return server_for(dict(os.environ))


def current_server() -> ForkServer | None:
    return _server


def processes_left() -> list:
    """This process's descendants other than the fork-server (which stays between launches), and whatever its
    launches started that escaped the tree (re-parented to init): after a launch has returned, or a `Workers` was
    closed, this is empty unless something outlived it."""
    import psutil

    server = current_server()
    left = [p for p in psutil.Process().children(recursive=True) if server is None or p.pid != server.pid]
    left += [p for p in sessions.launched_by(os.getpid()) if p not in left]
    if left:  # a worker's exit is reaped by the server a moment after the launch returns
        psutil.wait_procs(left, timeout=2)
        left = [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    return left


def stop_server() -> None:
    """Stop the server (and any worker it still has). The next launch starts a new one."""
    global _server
    with _server_lock:
        if _server is not None:
            _server.stop()
            _server = None


atexit.register(stop_server)
