"""Live, rank-prefixed output: the bytes a worker writes to its stdout or stderr pipe, as lines in the cell.

Why lines: two ranks writing at once must not interleave inside a line, so each stream is cut at newlines and
written whole, prefixed "[rank N] ". A carriage-return progress bar (tqdm) keeps only its last state per line.
Why a tail: a rank that dies without a Python exception (SIGABRT from a C++ `terminate`, a segfault) leaves its
reason only on stderr; the last lines are kept even when the launch is quiet, for the error message.
"""
from __future__ import annotations

import collections
import os

TAIL_BYTES = 64 << 10


class RankStream:
    """One rank's stdout or stderr: reads its pipe without blocking, writes complete prefixed lines."""

    def __init__(self, fd: int, rank: int, stream, keep_tail: bool = False):
        os.set_blocking(fd, False)
        self.fd, self.prefix, self.stream = fd, f"[rank {rank}] ", stream
        self.partial = b""
        self.closed = False
        self.tail: collections.deque[bytes] | None = collections.deque() if keep_tail else None
        self._tail_bytes = 0

    def pump(self) -> None:
        """Read what the pipe holds now; write the complete lines."""
        chunks = []
        while not self.closed:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:  # every writer has closed it: the rank (and anything it started) is gone
                self.closed = True
                break
            chunks.append(chunk)
        if chunks:
            self._emit(b"".join(chunks))

    def finish(self) -> None:
        """Read the rest and write the last partial line; close the pipe."""
        self.pump()
        if self.partial:
            self._emit(b"\n")
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            self.closed = True

    def tail_text(self) -> str:
        return b"".join(self.tail or ()).decode("utf-8", "backslashreplace")

    def _emit(self, data: bytes) -> None:
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()
        if not lines:
            return
        if self.tail is not None:
            for line in lines:
                self.tail.append(line + b"\n")
                self._tail_bytes += len(line) + 1
            while self._tail_bytes > TAIL_BYTES and len(self.tail) > 1:
                self._tail_bytes -= len(self.tail.popleft())
        text = "".join(self.prefix + line.decode("utf-8", "backslashreplace").split("\r")[-1] + "\n"
                       for line in lines)
        self.stream.write(text)
        self.stream.flush()
