"""The per-rank progress display: the latest `protocol.Progress` each rank reported, drawn in the cell.

Why a pipe of its own and not stdout: a rank writes its state (step, total, a few metrics) with one optional call,
`rank.report_progress`, to a pipe the launcher gave it, so progress never mixes with the rank's own prints, and the
supervisor wakes when progress arrives instead of polling files (`supervise` reads the pipe, `protocol` says what
travels on it). This module only draws: bars in a notebook, a throttled line elsewhere.
"""
from __future__ import annotations

import html
import sys
import time

from helpers.launcher.protocol import Progress


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (where rich displays render)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython else None
    return shell is not None and shell.__class__.__name__ == "ZMQInteractiveShell"


class ProgressDisplay:
    """Per-rank bars in a notebook (one display, updated in place) or a throttled line elsewhere: the latest state
    each rank reported, drawn at most every `min_interval` seconds (a state that arrives sooner is drawn at
    `redraw_at`, which the supervisor wakes for)."""

    def __init__(self, world_size: int, min_interval: float = 0.5):
        self.world_size = world_size
        self.min_interval = min_interval
        self.states: dict[int, Progress] = {}
        self.redraw_at: float | None = None  # a state arrived too soon after the last drawing: draw it then
        self._handle = None
        self._last = 0.0
        self._last_states: dict[int, Progress] = {}

    def update(self, rank: int, state: Progress) -> None:
        """Rank `rank` is at `state`: drawn now, or at `redraw_at` if the last drawing is too recent."""
        self.states[rank] = state
        if not self.draw():
            self.redraw_at = self._last + self.min_interval

    def redraw_if_due(self, now: float) -> None:
        if self.redraw_at is not None and now >= self.redraw_at:
            self.redraw_at = None
            self.draw(force=True)

    def draw(self, force: bool = False) -> bool:
        """Draw the states unless nothing changed or the last drawing is younger than min_interval (then False)."""
        states = self.states
        if not states or (states == self._last_states and not force):
            return True
        now = time.monotonic()
        if not force and now - self._last < self.min_interval:
            return False
        self._last, self._last_states = now, dict(states)
        if in_notebook():
            from IPython.display import HTML, display

            if self._handle is None:
                self._handle = display(HTML(self._html(states)), display_id=True)
            else:
                self._handle.update(HTML(self._html(states)))
        else:
            print("progress: " + " | ".join(self._text(r, s) for r, s in sorted(states.items())),
                  file=sys.stderr, flush=True)
        return True

    @staticmethod
    def _text(rank: int, s: Progress) -> str:
        shown = " ".join(f"{k}={v:.4g}" for k, v in s.metrics.items())
        return f"rank {rank} {s.step}/{s.total} {shown}".rstrip()

    def _html(self, states: dict[int, Progress]) -> str:
        rows = []
        for rank, s in sorted(states.items()):
            shown = html.escape(" ".join(f"{k}={v:.4g}" for k, v in s.metrics.items()))
            rows.append(f"<tr><td>rank {rank}</td><td><progress value='{s.step}' max='{max(1, s.total)}'>"
                        f"</progress></td><td>{s.step}/{s.total}</td><td>{shown}</td></tr>")
        return "<table>" + "".join(rows) + "</table>"
