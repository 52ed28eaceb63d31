"""Figures of notebooks 02 and 02b (DDP): loss and accuracy curves, the bucket sweep and overlap, compression, ZeRO bytes,
scaling.

Each function takes what the workers measured (plain lists and dicts) and returns the Figure; none measures.
"""
from __future__ import annotations

from helpers.measure.timing import summarize
from helpers.plots import new_figure


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over `window` points: per-step losses of a small batch are noisy."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def loss_curves(curves: dict[str, list[float]], window: int = 10, title: str = "training loss"):
    """Per-step training loss of each run (raw, faint; smoothed, solid), log scale."""
    fig, (ax,) = new_figure()
    for label, losses in curves.items():
        line, = ax.plot(range(1, len(losses) + 1), _smooth(losses, window), label=f"{label} (mean of {window})")
        ax.plot(range(1, len(losses) + 1), losses, color=line.get_color(), alpha=0.25, linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy")
    ax.set_title(title)
    ax.legend()
    return fig


def accuracy_curves(curves: dict[str, dict], title: str = "test accuracy"):
    """Test accuracy per epoch (left) and against optimizer steps (right); curves[label] = {'acc', 'steps'}."""
    fig, (by_epoch, by_step) = new_figure(2, width=5.2)
    for label, c in curves.items():
        epochs = range(1, len(c["acc"]) + 1)
        line, = by_epoch.plot(epochs, c["acc"], marker="o", markersize=3, label=label)
        by_step.plot(c["steps"], c["acc"], marker="o", markersize=3, color=line.get_color(), label=label)
    by_epoch.set_xlabel("epoch (same number of samples for every run)")
    by_step.set_xlabel("optimizer steps")
    by_step.set_xscale("log")
    for ax in (by_epoch, by_step):
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0, 1)
    by_epoch.legend(fontsize=8)
    fig.suptitle(title)
    return fig


def _cap_label(cap) -> str:
    return "default" if cap is None else f"{cap:g}"


def _summary(times) -> dict:
    """Step times as given: a list of seconds per repeat, or helpers.measure.timing.summarize of one."""
    return times if isinstance(times, dict) else summarize(times)


def bucket_sweep(rows: list[dict], predicted: list[int]):
    """Left: all-reduce calls per step, counted (dots) and predicted by DDP's greedy bucketing (line).
    Right: step time with its interquartile range, and the same step with no all-reduce at all (no_sync).
    rows[i]: {"cap", "buckets" (bytes of each), "sync" and "local" (seconds per repeat, or their summary)}."""
    fig, (calls, times) = new_figure(2, width=5.2)
    x = list(range(len(rows)))
    labels = [_cap_label(r["cap"]) for r in rows]
    calls.plot(x, predicted, color="0.6", linewidth=3, label="predicted (greedy bucketing)")
    calls.plot(x, [len(r["buckets"]) for r in rows], "o", color="C0", label="counted by a comm hook")
    calls.set_ylabel("all-reduce calls per step")
    calls.legend(fontsize=8)
    for key, label, colour in (("sync", "DDP step", "C1"), ("local", "same step under no_sync (no all-reduce)", "C2")):
        stats = [_summary(r[key]) for r in rows]
        med = [s["median_s"] * 1e3 for s in stats]
        low = [(s["median_s"] - s["q1_s"]) * 1e3 for s in stats]
        high = [(s["q3_s"] - s["median_s"]) * 1e3 for s in stats]
        times.errorbar(x, med, yerr=[low, high], marker="o", capsize=3, color=colour, label=label)
    times.set_ylabel("ms per step (median, IQR)")
    times.set_ylim(bottom=0)
    times.legend(fontsize=8)
    for ax in (calls, times):
        ax.set_xticks(x, labels)
        ax.set_xlabel("bucket_cap_mb")
    return fig


def compression(rows: list[dict]):
    """Bytes all-reduced per step and final test accuracy of each comm hook (and its median step time, where the
    rows carry "step_s")."""
    rows = [r for r in rows if r.get("supported", True)]
    timed = all("step_s" in r for r in rows)
    fig, (sent, acc, *step) = new_figure(3 if timed else 2, width=4.0)
    names = [r["method"] for r in rows]
    x = list(range(len(rows)))
    sent.bar(x, [r["bytes_per_step"] / 1e6 for r in rows], color="C0")
    sent.set_yscale("log")
    sent.set_ylabel("MB all-reduced per step (log)")
    acc.bar(x, [r["accuracy"] for r in rows], color="C2")
    acc.set_ylim(max(0.0, min(r["accuracy"] for r in rows) - 0.1), 1.0)
    acc.set_ylabel("final test accuracy")
    if timed:
        step[0].bar(x, [r["step_s"] * 1e3 for r in rows], color="C1")
        step[0].set_ylabel("median ms per step")
    for ax in (sent, acc, *step):
        ax.set_xticks(x, names, rotation=30, ha="right")
    return fig


def zero_memory(per_rank: dict[str, list[dict]], formula: dict[str, float]):
    """Bytes of parameters, gradients and optimizer state on each rank, per setup, beside ZeRO's formula
    (formula[setup] = total bytes per rank it predicts)."""
    fig, (ax,) = new_figure(width=7.0)
    parts = ("parameters", "gradients", "optimizer")
    x, labels = 0, []
    for setup, ranks in per_rank.items():
        for rank, held in enumerate(ranks):
            bottom = 0.0
            for i, part in enumerate(parts):
                ax.bar(x, held[part] / 1e6, bottom=bottom, color=f"C{i}", label=part if x == 0 else None)
                bottom += held[part] / 1e6
            ax.hlines(formula[setup] / 1e6, x - 0.4, x + 0.4, colors="k", linestyles="--",
                      label="ZeRO formula" if x == 0 else None)
            labels.append(f"{setup}\nrank {rank}")
            x += 1
        x += 0.5
    positions = [i + 0.5 * (i // len(next(iter(per_rank.values())))) for i in range(len(labels))]
    ax.set_xticks(positions, labels, fontsize=8)
    ax.set_ylabel("MB per rank")
    ax.legend(fontsize=8)
    return fig


def scaling(rows: list[dict], warn_above: int | None = None):
    """Samples per second against world size (measured and ideal n * T_1), and efficiency T_n / (n * T_1)."""
    if not rows or any(not r["samples_per_s"] > 0 for r in rows):
        raise ValueError("every row needs a positive, finite samples_per_s")
    fig, (thr, eff) = new_figure(2, width=5.0)
    ns = [r["world_size"] for r in rows]
    t1 = rows[0]["samples_per_s"] / rows[0]["world_size"]
    thr.plot(ns, [r["samples_per_s"] for r in rows], "o-", label="measured")
    thr.plot(ns, [n * t1 for n in ns], "--", color="0.5", label="ideal n x T_1")
    thr.set_ylabel("samples / s")
    thr.legend(fontsize=8)
    eff.plot(ns, [r["samples_per_s"] / (r["world_size"] * t1) for r in rows], "o-", color="C1")
    eff.axhline(1.0, color="0.5", linestyle="--")
    eff.set_ylim(0, max(1.2, max(r["samples_per_s"] / (r["world_size"] * t1) for r in rows) * 1.1))
    eff.set_ylabel("efficiency T_n / (n T_1)")
    for ax in (thr, eff):
        ax.set_xlabel("world size")
        ax.set_xticks(ns)
        if warn_above is not None and max(ns) > warn_above:
            ax.axvspan(warn_above + 0.5, max(ns) + 0.5, color="red", alpha=0.08)
    return fig


def overlap_timeline(measured: list[dict], title: str = "one DDP step: computation and communication"):
    """Per rank, the computation and communication spans of one step on one time axis (ms from the rank's first
    span); measured[rank] is helpers.measure.trace_overlap.overlap(...) of that rank's trace."""
    fig, (ax,) = new_figure(width=8.0, height=1.2 + 0.9 * len(measured))
    for rank, m in enumerate(measured):
        spans = m["compute_intervals"] + m["comm_intervals"]
        t0 = min((a for a, _ in spans), default=0.0)
        for row, (key, colour, label) in enumerate((("compute_intervals", "C0", "computation"),
                                                    ("comm_intervals", "C1", "communication (all-reduce)"))):
            ax.broken_barh([((a - t0) / 1e3, (b - a) / 1e3) for a, b in m[key]], (2 * rank + row - 0.4, 0.8),
                           color=colour, label=label if rank == 0 else None)
    ax.set_yticks([2 * r + k for r in range(len(measured)) for k in (0, 1)],
                  [f"rank {r} {k}" for r in range(len(measured)) for k in ("compute", "comm")])
    ax.set_xlabel("ms since the rank's first span")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    return fig
