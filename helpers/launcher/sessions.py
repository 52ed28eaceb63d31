"""Stopping a process together with everything it started: one implementation for launch and run_torchrun.

Why sessions: every worker (and every torchrun agent the notebooks start) is the leader of a process session of
its own, so one `killpg` reaches it and whatever it started (a DataLoader's workers, a torchrun's ranks, a
subprocess a cell's function ran) without touching the kernel. A process that has left the session (setsid in a
grandchild) is found through psutil's process tree, taken before the first signal, while its parent still lives.
Reaping is the parent's business: `wait(pid, timeout)` answers when a process is gone, whoever its parent is.

Why subreapers: a process whose parent dies is re-parented to init, out of every tree psutil can walk from here,
and out of the session too if it called setsid (a torchrun worker, `Popen(start_new_session=True)`). So each
worker, and the fork-server, is a child subreaper (Linux's PR_SET_CHILD_SUBREAPER): an orphan below it is
re-parented to it instead. A worker ends its whole tree before it exits (`end_descendants`); the server kills any
orphan it adopts from a worker that was killed before it could (`kill_orphans`).
"""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import Callable, Iterable


def descendants(pid: int) -> list:
    """psutil handles of every process below `pid` (empty when psutil is missing or pid is gone)."""
    try:
        import psutil

        return psutil.Process(pid).children(recursive=True)
    except Exception:  # noqa: BLE001 - psutil missing or the process already gone
        return []


# In every worker's environment, so in its descendants' (unless one clears its environment): the launching
# process's pid. A process that escaped every tree (re-parented to init) is still found by it (`launched_by`).
LAUNCHED_BY_VAR = "COOKBOOK_LAUNCHED_BY"
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def prctl(option: int, value: int) -> bool:
    """Linux's prctl(2) on this process; False elsewhere or if the kernel refuses."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0


def become_subreaper() -> bool:
    """Orphans among this process's descendants are re-parented to it (not to init): they stay in its tree."""
    return prctl(PR_SET_CHILD_SUBREAPER, 1)


def end_processes(processes: list, grace: float = 1.0) -> None:
    """SIGTERM each psutil process, SIGKILL what is left after `grace` seconds; reaped if they are our children."""
    if not processes:
        return
    import psutil

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for process in processes:
            try:
                process.send_signal(sig)
            except psutil.Error:
                pass
        _, processes = psutil.wait_procs(processes, timeout=grace)
        if not processes:
            return


def end_descendants(grace: float = 1.0) -> None:
    """Every process below this one (orphans it adopted as a subreaper included) ended: what a rank leaves."""
    for _ in range(3):  # one that forked meanwhile is caught on the next round
        left = descendants(os.getpid())
        if not left:
            return
        end_processes(left, grace)


def kill_orphans(known: set[int]) -> None:
    """SIGKILL this process's children other than `known`, with their trees: the orphans a subreaper adopted.

    Nothing is waited for: they are this process's children, reaped when their SIGCHLD comes."""
    try:
        import psutil

        orphans = [c for c in psutil.Process().children() if c.pid not in known]
    except Exception:  # noqa: BLE001 - psutil missing
        return
    for process in [d for o in orphans for d in [o, *descendants(o.pid)]]:
        try:
            process.kill()
        except psutil.Error:
            pass


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


def launched_by(pid: int) -> list:
    """The living processes (of any parent) whose environment says that process `pid` launched them."""
    try:
        import psutil
    except ImportError:
        return []
    found = []
    for process in psutil.process_iter():
        try:
            if process.status() != psutil.STATUS_ZOMBIE and process.environ().get(LAUNCHED_BY_VAR) == str(pid):
                found.append(process)
        except psutil.Error:  # gone, or another user's
            pass
    return found
