"""What a failed launch reports: the root cause first, and where every rank that did not finish was.

Why a module: torch elastic's `ChildFailedError` names whichever rank it noticed first, which is often a peer's
"connection closed" rather than the rank that raised. Here a failure is a `RankFailure` (rank, exception type,
message, that rank's traceback, when it happened); `root_cause` picks the earliest one that is not a reaction to a
peer's; `WorkerError` puts it first and carries the others, the return values of the ranks that finished, and the
stacks of the ranks that were still running (a rank failed, its peers hung: both halves of the story).
Stacks come from faulthandler in the worker (file, line and function, even with the GIL held in C++); the kernel
adds each frame's source line with `linecache`, which also knows the cells of a Jupyter kernel.
"""
from __future__ import annotations

import linecache
import re
import signal
from dataclasses import dataclass

# Messages a rank raises because a *peer* went away: reported, but never as the root cause.
SECONDARY = re.compile(
    r"connection closed by peer|connection reset|broken pipe|econnreset|recvbytes|sendbytes|"
    r"nccl communicator was aborted|connectfullmesh failed|socket closed|peer.*(closed|disconnected)|"
    r"failed to recv|read error|timed out waiting for", re.IGNORECASE)
_FRAME = re.compile(r'^(\s*)File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>.+)$')
# The worker's entry frame: everything below it is the launcher starting the worker, not the user's code.
ENTRY_FUNCTION = "run_worker"


@dataclass
class RankFailure:
    rank: int
    kind: str  # exception type name, or "exit"
    message: str
    traceback: str = ""
    time: float = 0.0
    exception: BaseException | None = None

    @property
    def secondary(self) -> bool:
        return bool(SECONDARY.search(self.message))

    def headline(self) -> str:
        return f"rank {self.rank} {'raised ' + self.kind if self.kind != 'exit' else 'died'}: {self.message}"


def root_cause(failures: list[RankFailure]) -> RankFailure:
    """The earliest failure that is not a reaction to a peer's; the earliest of all if every one is."""
    primary = [f for f in failures if not f.secondary] or failures
    return min(primary, key=lambda f: (f.time, f.rank))


def signal_name(number: int) -> str:
    """'SIGKILL' for 9; the number itself for a signal this platform does not name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def exit_message(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"killed by signal {signal_name(-exitcode)} before returning (no Python exception)"
    return f"exited with code {exitcode} before returning (no Python exception: os._exit or a crash)"


def annotate_stack(stack: str) -> str:
    """faulthandler's dump, trimmed below the worker's entry, each frame followed by its source line."""
    out, skip = [], False
    for line in stack.splitlines():
        if line.startswith(("Thread ", "Current thread ")):
            skip = False
        if skip:
            continue
        out.append(line)
        frame = _FRAME.match(line)
        if frame:
            source = linecache.getline(frame["file"], int(frame["line"])).strip()
            if source:
                out.append(f"{frame.group(1)}    {source}")
            if frame["func"].strip() == ENTRY_FUNCTION:  # kept: a rank can hang in the launcher's own code
                skip = True
    return "\n".join(out)


def format_stacks(stacks: dict[int, str], title: str) -> str:
    return "".join(f"\n\n--- {title.format(rank=rank)} ---\n{stack.rstrip() or '(no stack could be taken)'}"
                   for rank, stack in sorted(stacks.items()))


class ExitHangWarning(UserWarning):
    """A rank reported its result (or error) but did not exit: it was stopped, and what it reported kept."""


class WorkerError(RuntimeError):
    """A rank failed. `rank`, `kind`, `message` and `traceback` describe the root cause; `failures` all of them;
    `results` the return values of the ranks that finished (a parameter server's record when a trainer died);
    `stacks` where each rank that was still running when the launch gave up was."""

    def __init__(self, root: RankFailure, failures: list[RankFailure], results: dict | None = None,
                 stacks: dict[int, str] | None = None):
        self.rank, self.kind, self.message = root.rank, root.kind, root.message
        self.results = dict(results or {})  # return values of the ranks that did return, by rank
        self.returned = sorted(self.results)
        self.stacks = dict(stacks or {})
        self.traceback, self.failures, self.original = root.traceback, failures, root.exception
        others = [f for f in failures if f is not root]
        text = root.headline()
        if root.traceback:
            text += f"\n\n--- traceback of rank {root.rank} ---\n{root.traceback.rstrip()}"
        if others:
            text += "\n\nother ranks:\n" + "\n".join(
                f"  {'(secondary) ' if f.secondary else ''}{f.headline().splitlines()[0][:300]}" for f in others)
        if root.secondary and self.returned:
            text += (f"\n\nranks {self.returned} had already returned: a rank that leaves while its peers still "
                     "wait in a collective is the usual cause of this error.")
        if self.stacks:
            text += (f"\n\nranks {sorted(self.stacks)} were still running after it and were stopped:"
                     + format_stacks(self.stacks, "where rank {rank} was"))
        super().__init__(text)


class LaunchTimeout(TimeoutError):
    """The launch outlived its timeout. `stacks` maps each rank that was still running to its Python stack."""

    def __init__(self, timeout: float, stacks: dict[int, str], finished: list[int]):
        self.timeout, self.stacks, self.finished = timeout, stacks, finished
        text = f"launch timed out after {timeout:g} s; ranks still running: {sorted(stacks)}"
        if finished:
            text += f"; ranks that had returned: {finished}"
        text += format_stacks(stacks, "where rank {rank} was stuck")
        super().__init__(text)
