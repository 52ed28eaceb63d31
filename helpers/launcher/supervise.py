"""Watching a launch's workers until each has returned, failed, or run out of time.

Why a selector and deadlines: the kernel waits on the workers' output pipes, their progress pipes and their exit
notices (the fork-server's messages, or a pidfd for a spawned worker) together, with the nearest deadline as the
timeout: the launch's timeout, the grace its failed rank's peers get, a reported rank's grace to exit, the next
redraw of the progress display. So it wakes only when something happened, never on a timer, and a launch costs
the kernel nothing while its workers compute.

What the supervisor decides: the results by rank; the failures, whose root cause `errors.root_cause` picks; the
stacks of ranks still running when it gives up (after the timeout, or after a failure's grace), each stopped.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import selectors
import signal
import socket
import threading
import time
import warnings
from dataclasses import dataclass, field

from helpers.launcher.errors import (ExitHangWarning, LaunchTimeout, RankFailure, WorkerError, annotate_stack,
                                     exit_message, root_cause)
from helpers.launcher import outcome
from helpers.launcher.output import RankStream, read_available
from helpers.launcher.progress import ProgressDisplay, parse_line
from helpers.launcher.sessions import stop_sessions
from helpers.launcher.worker import STACK_SIGNAL

STDERR_TAIL_LINES = 40  # of a rank that died without a Python exception, in its WorkerError
STACK_WAIT_S = 2.0  # for faulthandler to write the stacks of stuck ranks


@dataclass
class RankSlot:
    """One rank of a launch: its process handle, its pipes, and what the supervisor knows of it."""
    rank: int
    worker: object  # server.ServerWorker or spawn.SpawnedWorker: pid, exit_fd(), exitcode(), wait_gone(t)
    out: RankStream
    err: RankStream
    progress_fd: int
    progress_partial: bytes = b""
    reported_at: float | None = None  # when it said its result or error is written
    done: bool = False


@dataclass
class Supervision:
    run_dir: str
    slots: list[RankSlot]
    timeout: float
    failure_grace: float
    exit_grace: float
    display: ProgressDisplay
    results: dict = field(default_factory=dict)
    failures: dict = field(default_factory=dict)
    progress: dict = field(default_factory=dict)
    deadline: float = 0.0
    first_failure_at: float | None = None
    redraw_at: float | None = None
    call: int | None = None  # persistent workers: the call whose "call_done" notices end the supervision
    outcome_dir: str | None = None  # where results and errors are written (default: run_dir)
    _exit_fds: dict = field(default_factory=dict)  # a readable fd -> the workers whose exit it announces

    def run(self, timeout: float | None = None) -> list:
        """Results ordered by rank; raises WorkerError (root cause first) or LaunchTimeout.

        timeout: seconds from now (default: the supervision's own `timeout`)."""
        self.deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        self._exit_fds = {}
        selector = selectors.DefaultSelector()
        try:
            for slot in self.slots:
                for kind, stream in (("out", slot.out), ("err", slot.err)):
                    if not stream.closed:
                        selector.register(stream.fd, selectors.EVENT_READ, (kind, slot))
                selector.register(slot.progress_fd, selectors.EVENT_READ, ("progress", slot))
            for slot in self.slots:
                fd = slot.worker.exit_fd()
                if fd is not None:
                    workers = self._exit_fds.setdefault(fd, [])
                    if not workers:
                        selector.register(fd, selectors.EVENT_READ, ("exit", None))
                    workers.append(slot.worker)
            with _signals_wake(selector):
                stacks = self._loop(selector)
        finally:
            selector.close()
        if self.failures:
            ordered = sorted(self.failures.values(), key=lambda f: (f.time, f.rank))
            root = root_cause(ordered)
            raise WorkerError(root, [root] + [f for f in ordered if f is not root], self.results,
                              stacks) from root.exception
        if stacks is not None:
            raise LaunchTimeout(self.timeout, stacks, sorted(self.results))
        return [self.results[slot.rank] for slot in self.slots]

    def begin_call(self, call: int, call_dir: str, timeout: float, out_stream, err_stream) -> None:
        """Persistent ranks: supervise call number `call` next, whose outcomes go to `call_dir`, from the ranks of
        the calls before (still alive); its output goes to this cell's streams, its progress to a new display."""
        for slot in self.slots:
            slot.done, slot.reported_at = False, None
            slot.out.stream, slot.err.stream = out_stream, err_stream
        self.pump_all()  # what the ranks printed between calls
        self.results, self.failures, self.progress = {}, {}, {}
        self.display = ProgressDisplay(len(self.slots))
        self.call, self.outcome_dir, self.timeout, self.first_failure_at = call, call_dir, timeout, None

    def all_alive_and_done(self) -> bool:
        """Every rank has reported the current call and is still running: ready for the next one."""
        for slot in self.slots:
            slot.worker.poll()
        return all(slot.done and slot.worker.exitcode() is None for slot in self.slots)

    @property
    def pids(self) -> list[int]:
        return [slot.worker.pid for slot in self.slots]

    def signal_ranks(self, sig: int) -> None:
        """`sig` to every rank's process (not to its session)."""
        for slot in self.slots:
            try:
                os.kill(slot.worker.pid, sig)
            except ProcessLookupError:
                pass

    def wait_exited(self, timeout: float) -> None:
        """Wait up to `timeout` seconds in all for every rank to exit on its own."""
        deadline = time.monotonic() + timeout
        for slot in self.slots:
            slot.worker.wait_gone(max(0.0, deadline - time.monotonic()))

    def pump_all(self) -> None:
        """Show what the ranks have written so far (complete lines) and their progress."""
        for slot in self.slots:
            slot.out.pump()
            slot.err.pump()
            self._read_progress(slot)

    def finish(self) -> None:
        """Stop whatever still runs, then show the last output and progress (also after an interrupt)."""
        stop_sessions([s.worker.pid for s in self.slots if not s.done], self._gone)
        for slot in self.slots:
            slot.out.finish()
            slot.err.finish()
            self._read_progress(slot)
            os.close(slot.progress_fd)
            slot.worker.close()
        self.display.update(self.progress, force=True)

    # -- the loop
    def _loop(self, selector) -> dict | None:
        """Until every rank is done (None), or it gives up: the stacks of the ranks it stopped."""
        while True:
            self._collect_exited()
            live = [s for s in self.slots if not s.done]
            if not live:
                return None
            now = time.monotonic()
            if self.failures and self.first_failure_at is None:
                self.first_failure_at = now
            if self.first_failure_at is not None and now >= self.first_failure_at + self.failure_grace:
                return self._give_up(live)
            if now >= self.deadline:
                return self._give_up(live)
            for slot in live:
                if slot.reported_at is not None and now >= slot.reported_at + self.exit_grace:
                    self._stop_after_outcome(slot)
            if self.redraw_at is not None and now >= self.redraw_at:
                self.redraw_at = None
                self.display.update(self.progress, force=True)
            wake = [self.deadline, self.redraw_at] + [s.reported_at + self.exit_grace for s in live
                                                      if s.reported_at is not None]
            if self.first_failure_at is not None:
                wake.append(self.first_failure_at + self.failure_grace)
            if any(s.worker.exit_fd() is None for s in live):  # no exit notice on this platform: look again soon
                wake.append(time.monotonic() + 0.1)
            timeout = max(0.0, min(w for w in wake if w is not None) - time.monotonic())
            for key, _ in selector.select(timeout):
                kind, slot = key.data
                if kind == "signal":
                    slot()  # a cell interrupt: its KeyboardInterrupt is raised as this returns to Python code
                elif kind == "exit":
                    self._exit_notice(selector, key.fd)
                elif kind == "progress":
                    if not self._read_progress(slot):
                        selector.unregister(key.fd)
                else:
                    stream = slot.out if kind == "out" else slot.err
                    stream.pump()
                    if stream.closed:
                        selector.unregister(key.fd)

    def _exit_notice(self, selector, fd: int) -> None:
        workers = self._exit_fds[fd]
        workers[0].poll()  # one poll reads the news of every worker behind this fd
        if all(w.exit_fd() is None for w in workers):  # a pidfd spent, or a server that died
            selector.unregister(fd)

    def _read_progress(self, slot: RankSlot) -> bool:
        """Take in the progress lines waiting on the rank's pipe; False once the pipe is closed."""
        data, open_ = read_available(slot.progress_fd)
        slot.progress_partial += data
        *lines, slot.progress_partial = slot.progress_partial.split(b"\n")
        changed = False
        for line in lines:
            state = parse_line(line)
            if state is None:
                continue
            if state.get("event") == "reported":
                slot.reported_at = slot.reported_at or time.monotonic()
            elif state.get("event") == "call_done" and state.get("call") == self.call and not slot.done:
                self._collect(slot)
            elif "step" in state:
                self.progress[slot.rank] = state
                changed = True
        if changed and not self.display.update(self.progress):
            self.redraw_at = self.display.next_draw_at
        return open_

    # -- outcomes
    def _collect_exited(self) -> None:
        for slot in self.slots:
            if not slot.done and slot.worker.exitcode() is not None:
                slot.out.pump()
                slot.err.pump()
                self._collect(slot)

    def _collect(self, slot: RankSlot) -> None:
        """Record what an exited (or stopped) rank left behind: a result, an exception, or only its exit code."""
        slot.done = True
        reported = outcome.read(self.outcome_dir or self.run_dir, slot.rank)
        if reported is None:
            self.failures[slot.rank] = self._exit_failure(slot)
        elif reported[0] == "result":
            self.results[slot.rank] = reported[1]
        else:
            record, original = reported[1], None
            if record.get("exception"):
                try:
                    original = pickle.loads(record["exception"])
                except Exception:  # noqa: BLE001
                    original = None
            self.failures[slot.rank] = RankFailure(slot.rank, record["type"], record["message"],
                                                   record["traceback"], record["time"], original)

    def _exit_failure(self, slot: RankSlot) -> RankFailure:
        """A rank that ended without a result or an exception. Its last stderr lines stand in for the traceback
        (a C++ abort message, faulthandler's dump of a fatal signal), shown even when the launch was quiet."""
        slot.err.pump()
        lines = [line for line in annotate_stack(slot.err.tail_text()).splitlines()
                 if not line.startswith("Extension modules:")][-STDERR_TAIL_LINES:]
        traceback = (f"(its last {STDERR_TAIL_LINES} lines of stderr at most)\n" + "\n".join(lines)
                     if any(line.strip() for line in lines) else "")
        return RankFailure(slot.rank, "exit", exit_message(slot.worker.exitcode()), traceback, time=time.time())

    def _stop_after_outcome(self, slot: RankSlot) -> None:
        """A rank reported, then hung on its way out: keep what it reported, stop it, show where it hung."""
        stack = self._take_stacks([slot]).get(slot.rank, "")
        stop_sessions([slot.worker.pid], self._gone)
        self._collect(slot)
        outcome = "result" if slot.rank in self.results else "error"
        warnings.warn(
            f"rank {slot.rank} reported its {outcome} but had not exited {self.exit_grace:g} s later; it was "
            "stopped and what it reported kept. A finished rank hangs like this while freeing what its function "
            "made, typically torch waiting, with the GIL held, on a background thread (gloo's, after "
            f"destroy_process_group) that needs the GIL. Where it was:\n{stack.rstrip() or '(no stack taken)'}",
            ExitHangWarning, stacklevel=5)

    def _give_up(self, live: list[RankSlot]) -> dict:
        """Stacks of the ranks still running, then stop them (their outcome, if any, is kept)."""
        stacks = self._take_stacks(live)
        # what they reported before being stopped counts; what they raise because they are stopped does not
        reported = [s for s in live if outcome.reported(self.outcome_dir or self.run_dir, s.rank)]
        stop_sessions([s.worker.pid for s in live], self._gone)
        for slot in live:
            if slot in reported:
                self._collect(slot)
            slot.done = True
        return stacks

    def _take_stacks(self, slots: list[RankSlot]) -> dict[int, str]:
        """Each rank's Python stack (faulthandler, on STACK_SIGNAL), with source lines."""
        if STACK_SIGNAL is None:
            return {s.rank: "" for s in slots}
        for slot in slots:
            try:
                os.kill(slot.worker.pid, STACK_SIGNAL)
            except ProcessLookupError:
                pass
        paths = {s.rank: outcome.path(self.run_dir, "stack", s.rank) for s in slots}
        end = time.monotonic() + STACK_WAIT_S
        while time.monotonic() < end and not all(_size(p) for p in paths.values()):
            time.sleep(0.05)  # a one-off wait for the dumps, at the end of a launch
        time.sleep(0.1)  # let the last lines land
        stacks = {}
        for rank, path in paths.items():
            try:
                with open(path) as f:
                    stacks[rank] = annotate_stack(f.read())
            except OSError:
                stacks[rank] = ""
        return stacks

    def _gone(self, pid: int, timeout: float) -> bool:
        slot = next(s for s in self.slots if s.worker.pid == pid)
        return slot.worker.wait_gone(timeout)


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


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
