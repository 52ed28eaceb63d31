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


def elastic_trajectory(stretches: list[dict], title: str):
    """An elastic run's loss per step, one colour per generation of workers (from elastic_log.stretches), with a
    dashed line at the checkpoint each restart resumed from: the steps right of it, left of the previous
    generation's last step, were trained twice."""
    fig, ax = plt.subplots(figsize=(8, 3.4))
    for i, stretch in enumerate(stretches):
        steps = sorted(stretch["losses"])
        label = f"start {i + 1}: world {stretch['world']}, restart count {stretch['restart_count']}"
        line, = ax.plot(steps, [stretch["losses"][s] for s in steps], "o-", ms=3, lw=1, label=label)
        if i > 0 and steps:  # the checkpoint it resumed from: the step before its first (what it loaded)
            resumed = steps[0] - 1
            ax.axvline(resumed, color=line.get_color(), ls="--", lw=1)
            ax.annotate(f"world {stretches[i - 1]['world']}->{stretch['world']}: from step "
                        f"{resumed}", (resumed, 0.02),
                        xycoords=("data", "axes fraction"), rotation=90, va="bottom", ha="right", fontsize=7)
    ax.set(xlabel="global step", ylabel="loss (mean over the global batch)", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()
    return fig
