"""Figures of notebook 04 (RPC parameter server): sync against async training, staleness, compression.

Each function takes what the parameter server recorded (plain lists and dicts) and returns the Figure.
"""
from __future__ import annotations

from collections import Counter

from helpers.plots import new_figure


def ps_comparison(runs: dict[str, dict]):
    """Test accuracy and loss against wall time and against updates; staleness; updates per second.

    runs[label] = {'curve': [{'update', 'time', 'accuracy', 'loss'}, ...], 'staleness': [int, ...],
                   'updates': int, 'wall': float}.
    """
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13.0, 6.4), layout="constrained")
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
    (acc_time, acc_update, stale), (loss_time, loss_update, rate) = axes
    for i, (label, run) in enumerate(runs.items()):
        curve, colour = run["curve"], f"C{i}"
        for ax, x_key, y_key in ((acc_time, "time", "accuracy"), (acc_update, "update", "accuracy"),
                                 (loss_time, "time", "loss"), (loss_update, "update", "loss")):
            ax.plot([c[x_key] for c in curve], [c[y_key] for c in curve], marker="o", markersize=3,
                    color=colour, label=label)
        counts = Counter(run["staleness"])
        keys = sorted(counts)
        stale.bar([k + 0.4 * i - 0.2 for k in keys], [counts[k] / len(run["staleness"]) for k in keys],
                  width=0.4, color=colour, alpha=0.8, label=label)
        rate.bar(i, run["updates"] / run["wall"], color=colour, label=label)
    for ax in (acc_time, loss_time):
        ax.set_xlabel("wall time (s)")
    for ax in (acc_update, loss_update):
        ax.set_xlabel("parameter updates")
    for ax in (acc_time, acc_update):
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0, 1)
    for ax in (loss_time, loss_update):
        ax.set_ylabel("test loss")
        ax.set_yscale("log")
    stale.set_xlabel("staleness (updates applied since the trainer's copy)")
    stale.set_ylabel("share of updates")
    rate.set_xticks(range(len(runs)), list(runs))
    rate.set_ylabel("updates per second")
    acc_time.legend(fontsize=8)
    return fig


def compression(rows: list[dict]):
    """Bytes a trainer uploads per update (log scale) and final test accuracy, one bar per codec."""
    fig, (sent, acc) = new_figure(2, width=4.8)
    x = list(range(len(rows)))
    names = [r["codec"] for r in rows]
    sent.bar(x, [r["bytes_per_update"] for r in rows], color="C0")
    sent.set_yscale("log")
    sent.set_ylabel("bytes uploaded per update (log)")
    acc.bar(x, [r["accuracy"] for r in rows], color="C2")
    acc.set_ylim(max(0.0, min(r["accuracy"] for r in rows) - 0.1), 1.0)
    acc.set_ylabel("final test accuracy")
    for ax in (sent, acc):
        ax.set_xticks(x, names, rotation=25, ha="right", fontsize=8)
    return fig
