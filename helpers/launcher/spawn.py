"""The explicit, slower start method: each worker a fresh interpreter, a child of the kernel.

Why keep it: it needs no server, and it is what macOS and Windows get by default (no fork-server there: fork is
unsafe on macOS once system frameworks have started threads). Its cost is `import torch` in every worker on every
launch (seconds; `./cookbook bench` prints both on this machine). The worker reads its function, arguments and
the kernel's state from the run folder exactly as a forked one does (`rank.run_worker`).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


class SpawnedWorker:
    """A worker started as `python -c ...`, with the few methods the supervisor uses."""

    def __init__(self, run_dir: str, rank: int, fds: list[int], env: dict, cwd: str):
        out, err, progress, *command = fds
        helpers_root = str(Path(__file__).resolve().parents[2])
        code = (f"import sys; sys.path.insert(0, {helpers_root!r}); from helpers.launcher.rank import spawn_main; "
                f"spawn_main({run_dir!r}, {rank}, {progress}, {command[0] if command else None})")
        self._popen = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=cwd, start_new_session=True,
                                       stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                       pass_fds=(progress, *command))
        self.pid = self._popen.pid
        self._pidfd = os.pidfd_open(self.pid) if hasattr(os, "pidfd_open") else None

    def exit_fd(self) -> int | None:
        """A pidfd: readable once the worker has exited (Linux); None once it has, or on other platforms."""
        return None if self._popen.returncode is not None else self._pidfd

    def poll(self) -> None:
        self._popen.poll()

    def exitcode(self) -> int | None:
        return self._popen.poll()

    def wait_gone(self, timeout: float) -> bool:
        try:
            self._popen.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
