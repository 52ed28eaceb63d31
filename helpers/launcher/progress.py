"""A per-rank progress display for long work, that costs the worker one optional call.

Why a pipe of its own and not stdout: a rank writes its latest state (step, total, a few metrics) as one JSON line
to a pipe the launcher gave it (COOKBOOK_PROGRESS_FD), so progress never mixes with the rank's own prints, and the
launcher's supervisor wakes when progress arrives instead of polling files. A line is shorter than PIPE_BUF, so
lines of one rank never interleave. Outside `helpers.launch` (under torchrun, say) `report_progress` prints a line
every tenth of the work. The same pipe carries the worker's "reported" notice (its result or error is written).
"""
from __future__ import annotations

import html
import json
import os
import sys
import time

PROGRESS_FD_VAR = "COOKBOOK_PROGRESS_FD"


def _send_line(state: dict) -> bool:
    fd = os.environ.get(PROGRESS_FD_VAR)
    if not fd:
        return False
    try:
        os.write(int(fd), (json.dumps(state) + "\n").encode())
    except OSError:  # the launcher is gone (or this process was not started by it): fall back to printing
        return False
    return True


def report_progress(step: int, total: int, **metrics: float) -> None:
    """Tell the launcher (or the terminal) how far this rank is. Cheap enough to call every step."""
    state = {"step": int(step), "total": int(total), "time": time.time(),
             "metrics": {k: float(v) for k, v in metrics.items()}}
    if _send_line(state):
        return
    tenth = max(1, total // 10)
    if step % tenth == 0 or step == total:
        shown = " ".join(f"{k}={v:.4g}" for k, v in state["metrics"].items())
        print(f"[rank {os.environ.get('RANK', '0')}] {step}/{total} {shown}", flush=True)


def report_outcome(outcome: str) -> None:
    """The worker's notice that its result or error is written (the launcher then expects it to exit)."""
    _send_line({"event": "reported", "outcome": outcome})


def report_call_done(call: int, outcome: str) -> None:
    """A persistent rank's notice that its outcome of call number `call` is written (it then waits for the next)."""
    _send_line({"event": "call_done", "call": call, "outcome": outcome})


def parse_line(line: bytes) -> dict | None:
    """One line of a rank's progress pipe, or None if it is not one of ours."""
    try:
        state = json.loads(line)
    except ValueError:
        return None
    return state if isinstance(state, dict) else None


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
        self.states: dict[int, dict] = {}
        self.redraw_at: float | None = None  # a state arrived too soon after the last drawing: draw it then
        self._handle = None
        self._last = 0.0
        self._last_states: dict[int, dict] = {}

    def update(self, rank: int, state: dict) -> None:
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
    def _text(rank: int, s: dict) -> str:
        shown = " ".join(f"{k}={v:.4g}" for k, v in s["metrics"].items())
        return f"rank {rank} {s['step']}/{s['total']} {shown}".rstrip()

    def _html(self, states: dict[int, dict]) -> str:
        rows = []
        for rank, s in sorted(states.items()):
            shown = html.escape(" ".join(f"{k}={v:.4g}" for k, v in s["metrics"].items()))
            rows.append(f"<tr><td>rank {rank}</td><td><progress value='{s['step']}' max='{max(1, s['total'])}'>"
                        f"</progress></td><td>{s['step']}/{s['total']}</td><td>{shown}</td></tr>")
        return "<table>" + "".join(rows) + "</table>"
