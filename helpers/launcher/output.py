"""Live, rank-prefixed output: the bytes a worker writes to its stdout or stderr pipe, as lines in the cell.

Why lines: two ranks writing at once must not interleave inside a line, so each stream is cut at newlines and
written whole, prefixed "[rank N] ". A carriage-return progress bar (tqdm) keeps only its last state per line.
Why a tail: a rank that dies without a Python exception (SIGABRT from a C++ `terminate`, a segfault) leaves its
reason only on stderr; the last lines are kept even when the launch is quiet, for the error message.
Why panels too: in a live notebook the merged text of eight ranks is hard to follow, so each rank's lines also go
to a tab of its own (`RankPanels`, ipywidgets `Output`s). The merged, prefixed text always goes to the cell's
output as well: a kernel cannot tell whether a widget front end is watching, and an executed notebook read
without one (papermill's, in outputs/) must still show everything.
"""
from __future__ import annotations

import collections
import os

from helpers.launcher.protocol import read_available

TAIL_BYTES = 64 << 10


class RankPanels:
    """A tab per rank, each an ipywidgets Output holding that rank's lines (stderr in its own colour)."""

    def __init__(self, world_size: int, title: str = "ranks"):
        import ipywidgets

        self.outputs = [ipywidgets.Output(layout={"max_height": "20em", "overflow": "auto"})
                        for _ in range(world_size)]
        self.widget = ipywidgets.Tab(children=self.outputs)
        for rank in range(world_size):
            self.widget.set_title(rank, f"rank {rank}")
        self.title = title
        self.shown = False

    @classmethod
    def for_this_kernel(cls, world_size: int) -> "RankPanels | None":
        """Panels where a notebook front end may show them and ipywidgets is installed; None elsewhere."""
        from helpers.launcher.progress import in_notebook

        if not in_notebook():
            return None
        try:
            return cls(world_size)
        except ImportError:
            return None

    def write(self, rank: int, text: str, stderr: bool = False) -> None:
        if not self.shown:  # displayed at the first line, so a silent launch adds nothing to the cell
            from IPython.display import display

            display(self.widget)
            self.shown = True
        output = self.outputs[rank]
        (output.append_stderr if stderr else output.append_stdout)(text)


class RankStream:
    """One rank's stdout or stderr: reads its pipe without blocking, writes complete prefixed lines."""

    def __init__(self, fd: int, rank: int, stream, keep_tail: bool = False, panels: RankPanels | None = None):
        os.set_blocking(fd, False)
        self.fd, self.rank, self.prefix, self.stream = fd, rank, f"[rank {rank}] ", stream
        self.panels, self.is_stderr = panels, keep_tail
        self.partial = b""
        self.closed = False
        self.tail: collections.deque[bytes] | None = collections.deque() if keep_tail else None
        self._tail_bytes = 0

    def pump(self) -> None:
        """Read what the pipe holds now; write the complete lines."""
        if self.closed:
            return
        data, still_open = read_available(self.fd)
        self.closed = not still_open  # every writer has closed it: the rank (and anything it started) is gone
        if data:
            self._emit(data)

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
        plain = [line.decode("utf-8", "backslashreplace").split("\r")[-1] + "\n" for line in lines]
        self.stream.write("".join(self.prefix + line for line in plain))
        self.stream.flush()
        if self.panels is not None:
            self.panels.write(self.rank, "".join(plain), stderr=self.is_stderr)
