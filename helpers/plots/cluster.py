"""Figures of notebook 09: a training run's loss across torchrun restarts."""
from __future__ import annotations

import matplotlib.pyplot as plt


def restart_trajectory(reference: dict, attempts: dict, crash_at: int, title: str):
    """The uninterrupted run's loss per step as a line, each attempt's as markers, the crash as a vertical line."""
    fig, ax = plt.subplots(figsize=(7, 3.2))
    steps = sorted(reference)
    ax.plot(steps, [reference[s] for s in steps], color="0.7", lw=3, label="uninterrupted (1 node x 4)")
    for attempt, losses in sorted(attempts.items()):
        s = sorted(losses)
        ax.plot(s, [losses[i] for i in s], "o-" if attempt == 0 else "x--", ms=4, label=f"attempt {attempt}")
    ax.axvline(crash_at, color="red", ls=":", label="planted crash")
    ax.set(xlabel="step", ylabel="loss", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()
    return fig


def overlap_timeline(measured: list[dict], title: str):
    """Per rank, computation and communication spans on one time axis (from trace_overlap.overlap)."""
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.9 * len(measured)))
    for rank, m in enumerate(measured):
        t0 = min(a for a, _ in m["compute_intervals"] + m["comm_intervals"])
        for row, (key, color) in enumerate((("compute_intervals", "tab:blue"), ("comm_intervals", "tab:orange"))):
            spans = [((a - t0) / 1e3, (b - a) / 1e3) for a, b in m[key]]
            ax.broken_barh(spans, (rank * 2 + row - 0.4, 0.8), color=color,
                           label=("computation" if row == 0 else "communication") if rank == 0 else None)
    ax.set_yticks([r * 2 + k for r in range(len(measured)) for k in (0, 1)],
                  [f"rank {r} {k}" for r in range(len(measured)) for k in ("compute", "comm")])
    ax.set(xlabel="ms since the rank's first event", title=title)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    plt.show()
    return fig
