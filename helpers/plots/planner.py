"""Figures of notebook 10 (planning a layout): each rank's memory split by what holds it, against a device's
memory, with the bytes its collectives send per step; and the planner's bytes beside what the runs measured.

Each function takes plain numbers (a plan's per-rank rows and collective records, or a table of planned and
measured values); none plans or measures.
"""
from __future__ import annotations

from helpers.plots import new_figure

PARTS = ("parameters", "gradients", "optimizer", "activations", "transient", "allocator cache")
_COLORS = {"parameters": "#4C72B0", "gradients": "#DD8452", "optimizer": "#55A868", "activations": "#C44E52",
           "transient": "#8172B3", "allocator cache": "#CCCCCC"}
GIB = 2 ** 30


def rank_parts(row: dict) -> dict[str, float]:
    """One rank of a plan at its peak as {part: bytes}, adding up to the reserved bytes: the allocated parameters
    and optimizer state, the gradients (at the optimizer step; before it a step's own accumulating gradients count
    as transient), the kept and recomputed activations, the rest of what is allocated at that moment (gathered
    parameters, buckets, the loss's vocabulary-sized tensors), and what the caching allocator reserves beyond it."""
    memory, act = row["memory"], row["activations"]
    optimizer_step = memory["phase"] == "optimizer step"
    parts = {"parameters": row["allocated"]["parameters"],
             "gradients": row["allocated"]["gradients"] if optimizer_step else 0.0,
             "optimizer": row["allocated"]["optimizer"],
             "activations": 0.0 if optimizer_step else min(act["kept"] + act["recompute"],
                                                           memory["phases"][memory["phase"]])}
    parts["transient"] = max(0.0, memory["allocated"] - sum(parts.values()))
    parts["allocator cache"] = memory["reserved"] - memory["allocated"]
    return parts


def memory_and_traffic(ranks: list[dict], communication: list[dict], memory_bytes: float, title: str = ""):
    """Left: a stacked bar per rank (at most 16 drawn: the first of each stage and shard beyond that) of
    parameters, gradients, optimizer state, activations, transient buffers and the allocator's cache in GiB (the
    bar is the reserved memory), with the device's memory as a line. Right: GiB this rank sends per step, per
    collective."""
    fig, (ax_m, ax_c) = new_figure(ncols=2, width=4.8, height=3.4)
    shown = ranks[:16]
    for x, row in enumerate(shown):
        bottom = 0.0
        for part, value in rank_parts(row).items():
            ax_m.bar(x, value / GIB, 0.7, bottom=bottom, color=_COLORS[part], label=part if x == 0 else None)
            bottom += value / GIB
    ax_m.axhline(memory_bytes / GIB, color="black", linestyle="--", linewidth=1,
                 label=f"device memory {memory_bytes / GIB:.0f} GiB")
    ax_m.set_xticks(range(len(shown)), [str(r["rank"]) for r in shown], fontsize=7)
    ax_m.set_xlabel("rank" + (f" (first {len(shown)} of {len(ranks)})" if len(ranks) > len(shown) else ""))
    ax_m.set_ylabel("GiB at the step's peak (planned)")
    ax_m.legend(fontsize=7, loc="upper right")
    ax_m.set_title(title, fontsize=9)
    labels = [f"{c['kind']}\n{c['group']}" for c in communication]
    values = [c["sent_bytes"] / GIB for c in communication]
    ax_c.barh(range(len(values)), values, color="#937860")
    ax_c.set_yticks(range(len(values)), labels, fontsize=7)
    ax_c.set_xlabel("GiB sent by rank 0 per step (ring)")
    ax_c.set_title("communication per step", fontsize=9)
    if not values:
        ax_c.text(0.5, 0.5, "no communication", ha="center", va="center", transform=ax_c.transAxes)
    return fig


def planned_vs_measured(rows: list[dict]):
    """Per layout, measured over planned for what the runs compare: model state, bytes per collective, saved
    activations, step time (a log scale: a factor of 2 either way looks alike).

    rows: [{'layout': label, 'state': ratio, 'collectives': ratio, 'activations': ratio or None,
            'time': ratio or None}].
    """
    fig, (ax,) = new_figure(width=9.0, height=3.4)
    keys = ("state", "collectives", "activations", "time")
    colors = ("#4C72B0", "#DD8452", "#C44E52", "#55A868")
    width = 0.8 / len(keys)
    for k, (key, color) in enumerate(zip(keys, colors)):
        xs = [i + (k - 1.5) * width for i, r in enumerate(rows) if r.get(key)]
        ys = [r[key] for r in rows if r.get(key)]
        ax.bar(xs, ys, width, color=color, label=key)
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_yscale("log")
    ax.set_xticks(range(len(rows)), [r["layout"] for r in rows], fontsize=7, rotation=20, ha="right")
    ax.set_ylabel("measured / planned")
    ax.legend(fontsize=7, ncols=4)
    ax.set_title("the planner against the runs on this machine (1 = exact)", fontsize=9)
    return fig
