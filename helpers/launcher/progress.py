"""A per-rank progress display for long work, that costs the worker one optional call.

Why files and not stdout: a rank writes its latest state (step, total, a few metrics) to a small file that the
launcher reads while it waits, so progress never mixes with the rank's own prints and a slow kernel never blocks a
worker. Outside `helpers.launch` (under torchrun, say) `report_progress` prints a line every tenth of the work.
"""
from __future__ import annotations

import html
import json
import os
import sys
import time

RUN_DIR_VAR = "COOKBOOK_RUN_DIR"


def report_progress(step: int, total: int, **metrics: float) -> None:
    """Tell the launcher (or the terminal) how far this rank is. Cheap enough to call every step."""
    rank = int(os.environ.get("RANK", "0"))
    run_dir = os.environ.get(RUN_DIR_VAR)
    state = {"step": int(step), "total": int(total), "time": time.time(),
             "metrics": {k: float(v) for k, v in metrics.items()}}
    if run_dir:
        path = os.path.join(run_dir, f"progress.{rank}")
        with open(path + ".tmp", "w") as f:
            json.dump(state, f)
        os.replace(path + ".tmp", path)
        return
    tenth = max(1, total // 10)
    if step % tenth == 0 or step == total:
        shown = " ".join(f"{k}={v:.4g}" for k, v in state["metrics"].items())
        print(f"[rank {rank}] {step}/{total} {shown}", flush=True)


def read_progress(run_dir: str, world_size: int) -> dict[int, dict]:
    """Latest state of every rank that has reported."""
    states = {}
    for rank in range(world_size):
        try:
            with open(os.path.join(run_dir, f"progress.{rank}")) as f:
                states[rank] = json.load(f)
        except (OSError, ValueError):
            continue
    return states


def _in_notebook() -> bool:
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython else None
    return shell is not None and shell.__class__.__name__ == "ZMQInteractiveShell"


class ProgressDisplay:
    """Renders per-rank bars in a notebook (one display, updated in place) or a throttled line elsewhere."""

    def __init__(self, world_size: int, min_interval: float = 0.5):
        self.world_size = world_size
        self.min_interval = min_interval
        self._handle = None
        self._last = 0.0
        self._last_states: dict[int, dict] = {}

    def update(self, states: dict[int, dict], force: bool = False) -> None:
        if not states or (states == self._last_states and not force):
            return
        now = time.monotonic()
        if not force and now - self._last < self.min_interval:
            return
        self._last, self._last_states = now, dict(states)
        if _in_notebook():
            from IPython.display import HTML, display

            if self._handle is None:
                self._handle = display(HTML(self._html(states)), display_id=True)
            else:
                self._handle.update(HTML(self._html(states)))
        else:
            print("progress: " + " | ".join(self._text(r, s) for r, s in sorted(states.items())),
                  file=sys.stderr, flush=True)

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
