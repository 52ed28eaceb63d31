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
