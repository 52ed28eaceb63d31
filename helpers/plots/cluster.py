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


def elastic_trajectory(stretches: list[dict], title: str):
    """An elastic run's loss per step, one colour per generation of workers (from elastic_log.stretches), with a
    dashed line at the checkpoint each restart resumed from: the steps right of it, left of the previous
    generation's last step, were trained twice."""
    fig, ax = plt.subplots(figsize=(8, 3.4))
    for i, stretch in enumerate(stretches):
        steps = sorted(stretch["losses"])
        label = f"start {i + 1}: world {stretch['world']}, restart count {stretch['restart_count']}"
        line, = ax.plot(steps, [stretch["losses"][s] for s in steps], "o-", ms=3, lw=1, label=label)
        if i > 0:
            ax.axvline(stretch["last_saved_before"], color=line.get_color(), ls="--", lw=1)
            ax.annotate(f"world {stretches[i - 1]['world']}->{stretch['world']}: from step "
                        f"{stretch['last_saved_before']}", (stretch["last_saved_before"], 0.02),
                        xycoords=("data", "axes fraction"), rotation=90, va="bottom", ha="right", fontsize=7)
    ax.set(xlabel="global step", ylabel="loss (mean over the global batch)", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()
    return fig
