"""Stopping a process together with everything it started: one implementation for launch and run_torchrun.

Why sessions: every worker (and every torchrun agent the notebooks start) is the leader of a process session of
its own, so one `killpg` reaches it and whatever it started (a DataLoader's workers, a torchrun's ranks, a
subprocess a cell's function ran) without touching the kernel. A process that has left the session (setsid in a
grandchild) is found through psutil's process tree, taken before the first signal, while its parent still lives.
Reaping is the parent's business: `wait(pid, timeout)` answers when a process is gone, whoever its parent is.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Callable, Iterable


def descendants(pid: int) -> list:
    """psutil handles of every process below `pid` (empty when psutil is missing or pid is gone)."""
    try:
        import psutil

        return psutil.Process(pid).children(recursive=True)
    except Exception:  # noqa: BLE001 - psutil missing or the process already gone
        return []


def signal_session(pid: int, sig: int) -> None:
    """`sig` to pid's whole session (it leads one), or to pid alone if it has not become a leader yet."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError, AttributeError):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_sessions(pids: Iterable[int], is_gone: Callable[[int, float], bool], grace: float = 1.0) -> None:
    """SIGTERM each session, then SIGKILL what is left after `grace` seconds; psutil's tree catches strays.

    is_gone(pid, timeout): waits up to timeout for pid to have exited (and been reaped by whoever is its parent),
    returns whether it has.
    """
    pids = [p for p in pids if p]
    strays = [d for p in pids for d in descendants(p)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in pids if not is_gone(p, 0)]
        if not alive and not strays:
            return
        for p in alive:
            signal_session(p, sig)
        for d in strays:
            try:
                d.send_signal(sig)
            except Exception:  # noqa: BLE001 - already gone
                pass
        deadline = time.monotonic() + grace
        for p in alive:
            is_gone(p, max(0.0, deadline - time.monotonic()))
    for p in pids:
        is_gone(p, 5.0)
    try:
        import psutil

        psutil.wait_procs(strays, timeout=2)
    except Exception:  # noqa: BLE001
        pass
