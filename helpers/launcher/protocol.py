"""The messages that cross between the kernel, the fork-server and the ranks: each named and typed once, written and
read here only.

Why one module: a message has two ends in two processes, and when each end spells its fields its own way a rename
on one side is only found at run time, in a process whose traceback nobody sees. Here each message is a frozen
dataclass; `encode` writes any of them as one JSON object that names its kind, and `decode` reads one back as the
class its kind names, refusing what the channel does not carry. The channels and their framing:

    channel                       direction         messages                     framing
    a rank's progress pipe        rank -> kernel    Progress, Reported, CallDone one line each (`send_notice`)
    the fork-server's socket      kernel -> server  Fork (the rank's pipes attached)    one SEQPACKET message each
                                  server -> kernel  Ready, Forked, Exited
    a persistent rank's command   kernel -> rank    Call                         a 4-byte length, then the message
      pipe (`Workers`)                                                           (`send_call`, `receive_call`)

Why JSON: every field is a number, a string or a map of them, one format serves every channel, and reading a
message never runs code (unpickling may), so a stray line on a pipe is only dropped. A progress line is shorter
than PIPE_BUF, so the lines of one rank never interleave.

What does not travel here: payloads and outcomes are files in the run folder (`run_folder`, which also holds
STACK_SIGNAL beside the stack file it fills), and stdout and stderr are shown as they come (`output`); both are read
with `read_available`, as the progress pipe is.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import asdict, dataclass, fields

PROGRESS_FD_VAR = "COOKBOOK_PROGRESS_FD"  # a rank's progress pipe, in its environment
MESSAGE_BYTES = 1 << 20  # the largest message the fork-server's socket reads at once
MAX_FDS = 4  # a fork request's pipes: stdout, stderr, progress, and a persistent rank's commands
_LENGTH = struct.Struct("!I")


# ---------------------------------------------------------------------------------------- rank -> kernel (pipe)
@dataclass(frozen=True)
class Progress:
    """How far a rank is (`rank.report_progress`): drawn by `progress.ProgressDisplay`."""
    step: int
    total: int
    time: float
    metrics: dict[str, float]


@dataclass(frozen=True)
class Reported:
    """The rank's result or error is written (`outcome`: 'result' or 'error'); it exits next."""
    outcome: str


@dataclass(frozen=True)
class CallDone:
    """A persistent rank's outcome of call number `call` is written; it waits for the next call."""
    call: int
    outcome: str


# ------------------------------------------------------------------------------------- kernel <-> fork-server
@dataclass(frozen=True)
class Fork:
    """Fork a worker for `rank` of the launch whose run folder is `run_dir` (its pipes ride with the message)."""
    run_dir: str
    rank: int


@dataclass(frozen=True)
class Ready:
    """The server has imported what it preloads; `threads`: how many it holds (None where /proc is missing)."""
    pid: int
    threads: int | None


@dataclass(frozen=True)
class Forked:
    """The worker for `rank` of `run_dir` runs as `pid`."""
    run_dir: str
    rank: int
    pid: int


@dataclass(frozen=True)
class Exited:
    """Worker `pid` exited and was reaped; `exitcode` is negative when a signal killed it."""
    pid: int
    exitcode: int


# ----------------------------------------------------------------------------------- kernel -> persistent rank
@dataclass(frozen=True)
class Call:
    """Run call number `call`: its request and, afterwards, each rank's outcome are in the folder `dir`."""
    call: int
    dir: str


Notice = Progress | Reported | CallDone
NOTICES = (Progress, Reported, CallDone)  # what a progress pipe carries
SERVER_REPLIES = (Ready, Forked, Exited)  # what the fork-server sends the kernel
_KINDS = {cls.__name__: cls for cls in (*NOTICES, Fork, *SERVER_REPLIES, Call)}


def encode(message) -> bytes:
    """One message as a JSON object that names its kind."""
    return json.dumps({"kind": type(message).__name__, **asdict(message)}).encode()


def decode(data: bytes, kinds: tuple[type, ...]):
    """The message `data` encodes, if it is one of `kinds`; ValueError for anything else."""
    record = json.loads(data)
    cls = _KINDS.get(record.pop("kind", None)) if isinstance(record, dict) else None
    if cls not in kinds or set(record) != {f.name for f in fields(cls)}:
        raise ValueError(f"not one of {[k.__name__ for k in kinds]}: {data[:200]!r}")
    return cls(**record)


# ---------------------------------------------------------------------------------------------- the pipes
def read_available(fd: int) -> tuple[bytes, bool]:
    """What a non-blocking pipe holds now, and whether it is still open (False once every writer closed it)."""
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return b"".join(chunks), True
        except OSError:
            chunk = b""
        if not chunk:
            return b"".join(chunks), False
        chunks.append(chunk)


def send_notice(notice: Notice) -> bool:
    """Write `notice` to this rank's progress pipe; False where there is none (not started by the launcher, or
    the launcher is gone)."""
    fd = os.environ.get(PROGRESS_FD_VAR)
    if not fd:
        return False
    try:
        os.write(int(fd), encode(notice) + b"\n")
    except OSError:
        return False
    return True


class NoticeReader:
    """The kernel's end of one rank's progress pipe: bytes in, notices out."""

    def __init__(self, fd: int):
        os.set_blocking(fd, False)
        self.fd = fd
        self._partial = b""

    def read(self) -> tuple[list[Notice], bool]:
        """The notices waiting on the pipe (lines that are none are left out); and whether it is still open."""
        data, still_open = read_available(self.fd)
        *lines, self._partial = (self._partial + data).split(b"\n")
        notices = []
        for line in lines:
            try:
                notices.append(decode(line, NOTICES))
            except ValueError:  # json's errors are ValueErrors too
                pass
        return notices, still_open

    def close(self) -> None:
        os.close(self.fd)


def send_call(fd: int, call: Call) -> None:
    """The kernel's side of a command pipe: one call, length first."""
    data = encode(call)
    os.write(fd, _LENGTH.pack(len(data)) + data)


def receive_call(fd: int) -> Call | None:
    """A persistent rank's side of its command pipe: the next call, or None once the kernel has closed it."""
    header = _read_exactly(fd, _LENGTH.size)
    if header is None:
        return None
    return decode(_read_exactly(fd, _LENGTH.unpack(header)[0]), (Call,))


def _read_exactly(fd: int, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return None
        data += chunk
    return data
