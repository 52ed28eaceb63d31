"""Figures of notebooks 07, 08 and 08b (tensor, 2-D, pipeline, context and expert parallelism): where shards live,
what a strategy costs per step, a pipeline's bubble, the activation memory per rank against the sequence length, and
the bytes of each all-to-all.

Each function takes what the workers measured (plain dicts and lists) and the formula to draw beside it; none
measures.
"""
from __future__ import annotations

from helpers.plots import new_figure

_RANK_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C")


def owner_sets(results: list[dict], name: str) -> list[tuple[int, ...]]:
    """For each element of parameter `name` (flat, row-major), the ranks that hold it.

    results: one dict per rank with 'rank' and 'owners' {name: 1-D tensor or list of the global flat indices of
    the elements that rank holds}.
    """
    numel = max(int(max(r["owners"][name].tolist(), default=-1)) for r in results) + 1
    held: list[list[int]] = [[] for _ in range(numel)]
    for r in sorted(results, key=lambda r: r["rank"]):
        for i in r["owners"][name].tolist():
            held[int(i)].append(r["rank"])
    return [tuple(h) for h in held]


def shard_owners(results: list[dict], names: list[str]):
    """One panel per parameter: the tensor drawn as a grid (1-D tensors as one row), each element coloured by the
    set of ranks that hold it. Titles carry the shape and the DTensor placements.

    results: per rank {'rank', 'owners': {name: flat indices held}, 'shapes': {name: shape},
        'placements': {name: str}}.
    """
    import matplotlib.colors as mcolors
    import numpy as np

    fig, axes = new_figure(ncols=len(names), width=2.6, height=2.8)
    palette: dict[tuple[int, ...], str] = {}
    for ax, name in zip(axes, names):
        shape = tuple(results[0]["shapes"][name])
        rows, cols = (1, shape[0]) if len(shape) == 1 else (shape[0], int(np.prod(shape[1:])))
        sets = owner_sets(results, name)
        for s in sets:
            if s not in palette:
                palette[s] = _RANK_COLORS[s[0] % len(_RANK_COLORS)] if len(s) == 1 else \
                    mcolors.to_hex(np.mean([mcolors.to_rgb(_RANK_COLORS[k % len(_RANK_COLORS)]) for k in s], axis=0))
        keys = list(palette)
        image = np.array([keys.index(s) for s in sets]).reshape(rows, cols)
        ax.imshow(image, cmap=mcolors.ListedColormap([palette[k] for k in keys]), vmin=-0.5,
                  vmax=len(keys) - 0.5, aspect="auto", interpolation="nearest")
        ax.set_title(f"{name}\n{list(shape)}  {results[0]['placements'][name]}", fontsize=6.5)
        ax.set_xticks([])
        ax.set_yticks([])
        ax.grid(False)
    from matplotlib.patches import Patch

    fig.legend(handles=[Patch(color=c, label="rank " + " + ".join(map(str, s))) for s, c in palette.items()],
               loc="outside lower center", ncols=min(len(palette), 6), fontsize=7)
    fig.suptitle("which ranks hold each element (mesh dims: dp x tp)", fontsize=9)
    return fig


def step_times(cost: dict[str, dict], unit: float = 1e-3, unit_name: str = "ms"):
    """Median step time per strategy with its quartiles as an error bar, and the bytes one rank sends beside it.

    cost: {label: {'seconds': [per-step seconds], 'bytes_sent': bytes per step}}.
    """
    import statistics

    fig, (ax_t, ax_b) = new_figure(ncols=2, width=3.6, height=3.2)
    for x, (label, r) in enumerate(cost.items()):
        s = sorted(r["seconds"])
        q = statistics.quantiles(s, n=4, method="inclusive") if len(s) >= 2 else [s[0]] * 3
        med = statistics.median(s)
        ax_t.bar(x, med / unit, 0.6, color=_RANK_COLORS[x])
        ax_t.errorbar(x, med / unit, yerr=[[(med - q[0]) / unit], [(q[2] - med) / unit]], color="black", capsize=4)
        ax_b.bar(x, r["bytes_sent"] / 2**20, 0.6, color=_RANK_COLORS[x])
    for ax in (ax_t, ax_b):
        ax.set_xticks(range(len(cost)), list(cost))
    ax_t.set_ylabel(f"step time ({unit_name}), median and quartiles")
    ax_b.set_ylabel("MiB sent per rank per step (ring)")
    ax_t.set_title("step time (this machine, not a GPU node)", fontsize=9)
    ax_b.set_title("bytes communicated", fontsize=9)
    return fig


def bubble(rows: list[dict]):
    """Idle fraction of a pipeline step against the number of micro-batches m: the schedules' counted bubble, the
    formula (p - 1)/(m + p - 1) (or its interleaved form), and the measured idle time as points.

    rows: {'schedule', 'm', 'counted', 'formula' (None for a schedule it does not describe, the zero-bubble ones),
    'measured' (or None)}.
    """
    fig, (ax,) = new_figure(width=6.4, height=3.6)
    for i, name in enumerate(dict.fromkeys(r["schedule"] for r in rows)):
        mine = sorted((r for r in rows if r["schedule"] == name), key=lambda r: r["m"])
        color = _RANK_COLORS[i % len(_RANK_COLORS)]
        ms = [r["m"] for r in mine]
        described = [(r["m"], r["formula"]) for r in mine if r.get("formula") is not None]
        if described:
            ax.plot(*zip(*described), color=color, lw=1, ls="--")
        ax.plot(ms, [r["counted"] for r in mine], "o", color=color, mfc="none",
                label=f"{name}: counted" + (" (formula dashed)" if described else ""))
        measured = [(r["m"], r["measured"]) for r in mine if r.get("measured") is not None]
        if measured:
            ax.plot(*zip(*measured), "x", color=color, ms=7, label=f"{name}: measured idle time")
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("idle fraction of the step")
    ax.set_ylim(0, 1)
    ax.set_title("pipeline bubble", fontsize=10)
    ax.legend(fontsize=7)
    return fig


def _draw_timeline(ax, events: dict[int, list[tuple]], title: str) -> None:
    t0 = min(e[0] for evs in events.values() for e in evs)
    for rank, evs in events.items():
        for start, end, label in evs:
            color = "#8DB0DE" if label.startswith("F") else "#2E5A88"
            ax.barh(rank, end - start, left=start - t0, color=color, edgecolor="white", height=0.7)
            ax.annotate(label, ((start + end) / 2 - t0, rank), ha="center", va="center", fontsize=6,
                        color="black" if label.startswith("F") else "white")
    ax.set_yticks(sorted(events), [f"rank {r}" for r in sorted(events)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the step began")
    ax.set_title(title, fontsize=10)


def timeline(events: dict[int, list[tuple]], title: str = ""):
    """Each rank's actions over time as bars: events {rank: [(start_s, end_s, label)]}; forward light, backward dark."""
    fig, (ax,) = new_figure(width=7.0, height=0.5 + 0.5 * len(events))
    _draw_timeline(ax, events, title)
    return fig


def bubble_step(row: dict, sweep: list[dict] = ()):
    """One explored pipeline step: what each rank did (measured) beside the bubble of its schedule, the formula
    (p - 1)/(v·m + p - 1) as a curve over m, the sweep's measured idle fractions for that schedule as crosses, and
    this step's measured idle fraction as a star (its counted one as a circle on the curve).

    row: {'schedule', 'm', 'p', 'v', 'events' {rank: [(start_s, end_s, label)]}, 'counted', 'formula', 'measured'};
    sweep: rows with 'schedule', 'm', 'measured'.
    """
    import numpy as np

    fig, (left, right) = new_figure(ncols=2, width=4.8, height=0.9 + 0.5 * len(row["events"]) + 1.0)
    _draw_timeline(left, row["events"], f"{row['schedule']}, m = {row['m']}: what each rank did (measured)")
    p, v = row["p"], row["v"]
    mine = sorted((r["m"], r["measured"]) for r in sweep if r["schedule"] == row["schedule"])
    top = max([32, row["m"]] + [m for m, _ in mine])
    ms = np.geomspace(1, top, 200)
    right.plot(ms, (p - 1) / (v * ms + p - 1), color=_RANK_COLORS[0], lw=1, ls="--",
               label=f"(p - 1)/(v·m + p - 1), p = {p}, v = {v}")
    if mine:
        right.plot(*zip(*mine), "x", color=_RANK_COLORS[1], label="measured in the sweep")
    right.plot([row["m"]], [row["counted"]], "o", mfc="none", color=_RANK_COLORS[0], label="counted (this step)")
    right.plot([row["m"]], [row["measured"]], "*", ms=12, color=_RANK_COLORS[3], label="measured (this step)")
    right.set_xscale("log", base=2)
    ticks = [2 ** k for k in range(int(np.log2(top)) + 1)]
    right.set_xticks(ticks, [str(t) for t in ticks])
    right.set_ylim(0, 1)
    right.set_xlabel("micro-batches m")
    right.set_ylabel("idle fraction of the step")
    right.set_title(f"{row['schedule']}: the bubble", fontsize=10)
    right.legend(fontsize=7)
    return fig


def memory_against_length(lengths: list[int], measured: dict[str, list[float]], predicted: dict[str, list[float]],
                          unit: float = 2**20, unit_name: str = "MiB"):
    """Bytes one rank saves for backward against the sequence length: each series measured (points) and its
    prediction (a dashed line), e.g. one rank alone and each of N context-parallel ranks.

    lengths: the sequence lengths; measured, predicted: {label: one value per length}.
    """
    fig, (ax,) = new_figure(width=6.0, height=3.6)
    for i, (label, values) in enumerate(measured.items()):
        color = _RANK_COLORS[i % len(_RANK_COLORS)]
        ax.plot(lengths, [v / unit for v in values], "o", color=color, label=f"{label}: measured")
        if label in predicted:
            ax.plot(lengths, [v / unit for v in predicted[label]], color=color, lw=1, ls="--",
                    label=f"{label}: predicted")
    ax.set_xlabel("sequence length S (tokens)")
    ax.set_ylabel(f"saved for backward per rank ({unit_name})")
    ax.set_ylim(bottom=0)
    ax.set_title("activation memory per rank", fontsize=10)
    ax.legend(fontsize=7)
    return fig


def call_bytes(per_rank: dict[int, list[int]], formula: dict[int, list[int]], calls: list[str],
               title: str = "bytes of each all-to-all"):
    """The bytes of each call of a sequence (the all-to-alls of one step, in order), one bar per rank, with the
    formula's bytes as a black tick on each bar.

    per_rank, formula: {rank: one value per call}; calls: a label per call.
    """
    width = 0.8 / max(1, len(per_rank))
    fig, (ax,) = new_figure(width=max(6.0, 0.45 * len(calls) * max(1, len(per_rank))), height=3.6)
    for k, (rank, values) in enumerate(sorted(per_rank.items())):
        xs = [i + (k - (len(per_rank) - 1) / 2) * width for i in range(len(values))]
        ax.bar(xs, [v / 1024 for v in values], width, color=_RANK_COLORS[rank % len(_RANK_COLORS)],
               label=f"rank {rank}: measured")
        ax.plot(xs, [v / 1024 for v in formula[rank]], "_", color="black", ms=12, mew=2,
                label="formula" if k == 0 else None)
    ax.set_xticks(range(len(calls)), calls, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("KiB handed to the call")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    return fig
