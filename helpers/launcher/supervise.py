"""Watching a start's ranks until each has returned, failed, or run out of time; what they ended with, as an Outcome.

Why a selector and deadlines: the kernel waits on the workers' output pipes, their progress pipes and their exit
notices (the fork-server's messages, or a pidfd for a spawned worker) together, with the nearest deadline as the
timeout: the launch's timeout, the grace its failed rank's peers get, a reported rank's grace to exit, the next
redraw of the progress display. So it wakes only when something happened, never on a timer, and a launch costs
the kernel nothing while its workers compute.

What a watch decides, and returns as an `Outcome`: the results by rank; the failures, whose root cause
`errors.root_cause` picks; the stacks of ranks still running when it gave up (after the timeout, or after a
failure's grace), each stopped. `Outcome.values()` turns it into the results or the exception the cell sees.
A `Supervision` holds only what outlives one watch: the ranks' processes and pipes (`launch` watches them once,
`Workers` once per call).
"""
from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Protocol

from helpers.launcher import run_folder
from helpers.launcher.errors import (ExitHangWarning, LaunchTimeout, RankFailure, WorkerError, annotate_stack,
                                     exit_message, root_cause)
from helpers.launcher.output import RankStream
from helpers.launcher.progress import ProgressDisplay
from helpers.launcher.protocol import CallDone, NoticeReader, Progress, Reported
from helpers.launcher.run_folder import STACK_SIGNAL
from helpers.launcher.sessions import stop_sessions

STDERR_TAIL_LINES = 40  # of a rank that died without a Python exception, in its WorkerError
STACK_WAIT_S = 2.0  # for faulthandler to write the stacks of stuck ranks


class RankProcess(Protocol):
    """A rank's process as the supervisor sees it, however it was started: `server.ServerWorker` (forked by the
    fork-server, which reports its exit) or `spawn.SpawnedWorker` (a fresh interpreter, watched through a pidfd)."""
    pid: int

    def exit_fd(self) -> int | None:
        """A file descriptor that becomes readable when there is news of an exit; None when there is none to wait
        on (the process has exited, or this platform gives none: the supervisor then looks again soon)."""

    def poll(self) -> None:
        """Take in the news that `exit_fd` announced, without blocking."""

    def exitcode(self) -> int | None:
        """None while it runs; its exit code once it has exited (negative: killed by that signal)."""

    def wait_gone(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for it to have exited and been reaped; whether it has."""

    def close(self) -> None:
        """Release what the handle holds (a pidfd, an exit record)."""


@dataclass
class RankSlot:
    """One rank of a start: its process, its pipes, and what the supervisor knows of it in the current watch."""
    rank: int
    process: RankProcess
    out: RankStream
    err: RankStream
    notices: NoticeReader  # its progress pipe
    reported_at: float | None = None  # when it said its result or error is written
    done: bool = False


@dataclass(frozen=True)
class Outcome:
    """What one watch ended with: the results of the ranks that returned, the failures in the order they happened,
    and where each rank still running when it gave up was (None: it did not give up)."""
    results: dict[int, object]
    failures: list[RankFailure]
    stacks: dict[int, str] | None
    timeout: float

    def values(self) -> list:
        """The results ordered by rank; raises WorkerError (root cause first) or LaunchTimeout."""
        if self.failures:
            root = root_cause(self.failures)
            raise WorkerError(root, [root] + [f for f in self.failures if f is not root], self.results,
                              self.stacks) from root.exception
        if self.stacks is not None:
            raise LaunchTimeout(self.timeout, self.stacks, sorted(self.results))
        return [self.results[rank] for rank in sorted(self.results)]


@dataclass
class _Watch:
    """One watch's state, gone when it returns its Outcome."""
    outcome_dir: str  # where the ranks write this watch's results and errors
    call: int | None  # persistent ranks: the call whose CallDone notices count
    deadline: float
    display: ProgressDisplay
    results: dict = field(default_factory=dict)
    failures: dict = field(default_factory=dict)
    first_failure_at: float | None = None


@dataclass
class Supervision:
    """The ranks of one start, between and during watches."""
    run_dir: str
    slots: list[RankSlot]
    failure_grace: float
    exit_grace: float

    def watch(self, timeout: float, outcome_dir: str | None = None, call: int | None = None) -> Outcome:
        """Watch the ranks for up to `timeout` seconds, until each has reported (`call`: reported that call, for
        persistent ranks, whose outcomes go to `outcome_dir`) or exited, or it gives up; what they ended with."""
        w = _Watch(outcome_dir or self.run_dir, call, time.monotonic() + timeout, ProgressDisplay(len(self.slots)))
        selector = selectors.DefaultSelector()
        try:
            for slot in self.slots:
                for kind, stream in (("out", slot.out), ("err", slot.err)):
                    if not stream.closed:
                        selector.register(stream.fd, selectors.EVENT_READ, (kind, slot))
                selector.register(slot.notices.fd, selectors.EVENT_READ, ("notices", slot))
            announced: dict[int, list[RankProcess]] = {}  # a readable fd -> the processes whose exit it announces
            for slot in self.slots:
                fd = slot.process.exit_fd()
                if fd is not None:
                    if fd not in announced:
                        announced[fd] = []
                        selector.register(fd, selectors.EVENT_READ, ("exit", announced[fd]))
                    announced[fd].append(slot.process)
            with _signals_wake(selector):
                stacks = self._loop(w, selector)
        finally:
            selector.close()
            for slot in self.slots:
                self._read_notices(w, slot)
            w.display.draw(force=True)
        return Outcome(w.results, sorted(w.failures.values(), key=lambda f: (f.time, f.rank)), stacks, timeout)

    def begin_call(self, out_stream, err_stream) -> None:
        """Persistent ranks: ready the ranks of the calls before (still alive) for the next call, whose output goes
        to this cell's streams."""
        for slot in self.slots:
            slot.done, slot.reported_at = False, None
            slot.out.stream, slot.err.stream = out_stream, err_stream
        self.pump_all()  # what the ranks printed between calls

    def all_alive_and_done(self) -> bool:
        """Every rank has reported the current call and is still running: ready for the next one."""
        for slot in self.slots:
            slot.process.poll()
        return all(slot.done and slot.process.exitcode() is None for slot in self.slots)

    @property
    def pids(self) -> list[int]:
        return [slot.process.pid for slot in self.slots]

    def signal_ranks(self, sig: int) -> None:
        """`sig` to every rank's process (not to its session)."""
        for slot in self.slots:
            try:
                os.kill(slot.process.pid, sig)
            except ProcessLookupError:
                pass

    def wait_exited(self, timeout: float) -> None:
        """Wait up to `timeout` seconds in all for every rank to exit on its own."""
        deadline = time.monotonic() + timeout
        for slot in self.slots:
            slot.process.wait_gone(max(0.0, deadline - time.monotonic()))

    def pump_all(self) -> None:
        """Show what the ranks have written so far (complete lines); progress outside a watch is dropped."""
        for slot in self.slots:
            slot.out.pump()
            slot.err.pump()
            slot.notices.read()

    def finish(self) -> None:
        """Stop whatever still runs, then show the last output (also after an interrupt); close every pipe."""
        stop_sessions([s.process.pid for s in self.slots if not s.done], self._gone)
        for slot in self.slots:
            slot.out.finish()
            slot.err.finish()
            slot.notices.close()
            slot.process.close()

    # -- the loop
    def _loop(self, w: _Watch, selector) -> dict | None:
        """Until every rank is done (None), or it gives up: the stacks of the ranks it stopped."""
        while True:
            self._collect_exited(w)
            live = [s for s in self.slots if not s.done]
            if not live:
                return None
            now = time.monotonic()
            if w.failures and w.first_failure_at is None:
                w.first_failure_at = now
            if w.first_failure_at is not None and now >= w.first_failure_at + self.failure_grace:
                return self._give_up(w, live)
            if now >= w.deadline:
                return self._give_up(w, live)
            for slot in live:
                if slot.reported_at is not None and now >= slot.reported_at + self.exit_grace:
                    self._stop_after_outcome(w, slot)
            w.display.redraw_if_due(now)
            wake = [w.deadline, w.display.redraw_at] + [s.reported_at + self.exit_grace for s in live
                                                        if s.reported_at is not None]
            if w.first_failure_at is not None:
                wake.append(w.first_failure_at + self.failure_grace)
            if any(s.process.exit_fd() is None for s in live):  # no exit notice on this platform: look again soon
                wake.append(time.monotonic() + 0.1)
            timeout = max(0.0, min(t for t in wake if t is not None) - time.monotonic())
            for key, _ in selector.select(timeout):
                kind, data = key.data
                if kind == "signal":
                    data()  # a cell interrupt: its KeyboardInterrupt is raised as this returns to Python code
                elif kind == "exit":
                    data[0].poll()  # one poll reads the news of every process behind this fd
                    if all(p.exit_fd() is None for p in data):  # a pidfd spent, or a server that died
                        selector.unregister(key.fd)
                elif kind == "notices":
                    if not self._read_notices(w, data):
                        selector.unregister(key.fd)
                else:
                    stream = data.out if kind == "out" else data.err
                    stream.pump()
                    if stream.closed:
                        selector.unregister(key.fd)

    def _read_notices(self, w: _Watch, slot: RankSlot) -> bool:
        """Take in the notices waiting on the rank's progress pipe; False once the pipe is closed."""
        notices, open_ = slot.notices.read()
        for notice in notices:
            if isinstance(notice, Reported):
                slot.reported_at = slot.reported_at or time.monotonic()
            elif isinstance(notice, CallDone) and notice.call == w.call and not slot.done:
                self._collect(w, slot)
            elif isinstance(notice, Progress):
                w.display.update(slot.rank, notice)
        return open_

    # -- outcomes
    def _collect_exited(self, w: _Watch) -> None:
        for slot in self.slots:
            if not slot.done and slot.process.exitcode() is not None:
                slot.out.pump()
                slot.err.pump()
                self._collect(w, slot)

    def _collect(self, w: _Watch, slot: RankSlot) -> None:
        """Record what an exited (or stopped) rank left behind: a result, an exception, or only its exit code."""
        slot.done = True
        reported = run_folder.read_outcome(w.outcome_dir, slot.rank)
        if reported is None:
            w.failures[slot.rank] = self._exit_failure(slot)
        elif reported[0] == "result":
            w.results[slot.rank] = reported[1]
        else:
            w.failures[slot.rank] = reported[1]

    def _exit_failure(self, slot: RankSlot) -> RankFailure:
        """A rank that ended without a result or an exception. Its last stderr lines stand in for the traceback
        (a C++ abort message, faulthandler's dump of a fatal signal), shown even when the launch was quiet."""
        slot.err.pump()
        lines = [line for line in annotate_stack(slot.err.tail_text()).splitlines()
                 if not line.startswith("Extension modules:")][-STDERR_TAIL_LINES:]
        traceback = (f"(its last {STDERR_TAIL_LINES} lines of stderr at most)\n" + "\n".join(lines)
                     if any(line.strip() for line in lines) else "")
        return RankFailure(slot.rank, "exit", exit_message(slot.process.exitcode()), traceback, time=time.time())

    def _stop_after_outcome(self, w: _Watch, slot: RankSlot) -> None:
        """A rank reported, then hung on its way out: keep what it reported, stop it, show where it hung."""
        stack = self._take_stacks([slot]).get(slot.rank, "")
        stop_sessions([slot.process.pid], self._gone)
        self._collect(w, slot)
        outcome = "result" if slot.rank in w.results else "error"
        warnings.warn(
            f"rank {slot.rank} reported its {outcome} but had not exited {self.exit_grace:g} s later; it was "
            "stopped and what it reported kept. A finished rank hangs like this while freeing what its function "
            "made, typically torch waiting, with the GIL held, on a background thread (gloo's, after "
            f"destroy_process_group) that needs the GIL. Where it was:\n{stack.rstrip() or '(no stack taken)'}",
            ExitHangWarning, stacklevel=5)

    def _give_up(self, w: _Watch, live: list[RankSlot]) -> dict:
        """Stacks of the ranks still running, then stop them (their outcome, if any, is kept)."""
        stacks = self._take_stacks(live)
        # what they reported before being stopped counts; what they raise because they are stopped does not
        reported = [s for s in live if run_folder.reported(w.outcome_dir, s.rank)]
        stop_sessions([s.process.pid for s in live], self._gone)
        for slot in live:
            if slot in reported:
                self._collect(w, slot)
            slot.done = True
        return stacks

    def _take_stacks(self, slots: list[RankSlot]) -> dict[int, str]:
        """Each rank's Python stack (faulthandler, on STACK_SIGNAL), with source lines."""
        if STACK_SIGNAL is None:
            return {s.rank: "" for s in slots}
        for slot in slots:
            try:
                os.kill(slot.process.pid, STACK_SIGNAL)
            except ProcessLookupError:
                pass
        end = time.monotonic() + STACK_WAIT_S
        while time.monotonic() < end and not all(run_folder.stack_size(self.run_dir, s.rank) for s in slots):
            time.sleep(0.05)  # a one-off wait for the dumps, at the end of a launch
        time.sleep(0.1)  # let the last lines land
        return {s.rank: annotate_stack(run_folder.read_stack(self.run_dir, s.rank)) for s in slots}

    def _gone(self, pid: int, timeout: float) -> bool:
        slot = next(s for s in self.slots if s.process.pid == pid)
        return slot.process.wait_gone(timeout)


@contextlib.contextmanager
def _signals_wake(selector):
    """Make a signal (a cell interrupt) wake the selector, whichever thread of the kernel it was delivered to.

    Python runs a signal's handler in the main thread, but the kernel may receive it on another thread, and then
    the main thread's select() would sleep on until its next deadline. CPython writes each signal to the wakeup
    fd; ours is in the selector for the launch, and what it reads is passed on to the kernel's own wakeup fd (an
    event loop's), which is restored afterwards.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    theirs.setblocking(False)
    previous = signal.set_wakeup_fd(theirs.fileno(), warn_on_full_buffer=False)

    def forward():
        try:
            data = ours.recv(4096)
        except BlockingIOError:
            return
        if previous != -1:
            try:
                os.write(previous, data)
            except OSError:
                pass

    selector.register(ours, selectors.EVENT_READ, ("signal", forward))
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous)
        selector.unregister(ours)
        ours.close()
        theirs.close()
