"""Figures for notebooks 01 and 01b (and any later one that benchmarks collectives with helpers.measure.collectives).

Why these: what each rank holds before and after a collective is easier to read as a grid than as prose;
a ring's per-rank traffic against a root's is the whole argument for the ring; and bandwidth against size (with
the ceiling beside it) and time against size are the two views nccl-tests prints, one for each regime (latency
bound at small sizes, bandwidth bound at large ones); on one GPU, where busbw is 0, NCCL's one-rank copy against the
GPU's copy rate and the fixed cost of a call. Each function takes measured results and returns the Figure.
"""
from __future__ import annotations

from helpers.measure.ceilings import GB, human_bytes
from helpers.measure.collectives import COLLECTIVES, IN_PLACE, busbw_factor
from helpers.plots import new_figure


def _size_axis(ax, sizes) -> None:
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ax.set_xscale("log", base=2)
    shown = sorted(set(sizes))
    step = max(1, len(shown) // 7)
    ax.xaxis.set_major_locator(FixedLocator(shown[::step]))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: human_bytes(v)))
    ax.set_xlabel("message size S (full array)")
    for label in ax.get_xticklabels():
        label.set_rotation(30)


def _series(records: list[dict]) -> dict[tuple[str, str], list[dict]]:
    series: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        series.setdefault((r["collective"], r["backend"]), []).append(r)
    return {k: sorted(v, key=lambda r: r["size_bytes"]) for k, v in series.items()}


def bandwidth_and_latency(records: list[dict], ceilings: dict | None = None, title: str | None = None):
    """busbw against size (left, with the bandwidth ceilings) and time per call against size (right).

    One line per collective (colour) and backend (line style); shaded: the interquartile range over repeats.
    """
    fig, (ax_bw, ax_lat) = new_figure(2, width=6.4, height=4.2)
    backends = sorted({r["backend"] for r in records})
    styles = dict(zip(backends, ["-", "--", ":", "-."]))
    colours = {name: f"C{i}" for i, name in enumerate(COLLECTIVES)}
    for (name, backend), rows in _series(records).items():
        sizes = [r["size_bytes"] for r in rows]
        label = name if len(backends) == 1 else f"{name} ({backend})"
        kw = {"color": colours[name], "linestyle": styles[backend], "marker": "o", "markersize": 3}
        ax_bw.plot(sizes, [r["busbw"] / GB for r in rows], label=label, **kw)
        ax_bw.fill_between(sizes, [r["busbw_q1"] / GB for r in rows], [r["busbw_q3"] / GB for r in rows],
                           color=colours[name], alpha=0.12, linewidth=0)
        ax_lat.plot(sizes, [r["median_s"] * 1e6 for r in rows], label=label, **kw)
        ax_lat.fill_between(sizes, [r["q1_s"] * 1e6 for r in rows], [r["q3_s"] * 1e6 for r in rows],
                            color=colours[name], alpha=0.12, linewidth=0)
    for i, c in enumerate((ceilings or {}).values()):
        if c["kind"] == "bandwidth":
            ax_bw.axhline(c["rate"] / GB, color="0.35", linestyle=[":", "--", "-."][i % 3], linewidth=1.2,
                          label=f"ceiling: {c['name']} {c['rate'] / GB:.3g} GB/s")
        elif c["kind"] == "latency":
            ax_lat.axhline(c["latency_s"] * 1e6, color="0.35", linestyle=":", linewidth=1.2,
                           label=f"floor: {c['name']} {c['latency_s'] * 1e6:.3g} us")
    all_sizes = [r["size_bytes"] for r in records]
    for ax in (ax_bw, ax_lat):
        _size_axis(ax, all_sizes)
        ax.set_yscale("log")
    ax_bw.set_ylabel("busbw (GB/s, 1 GB = 1e9 B), median")
    ax_lat.set_ylabel("time per call (us), slowest rank, median")
    ax_bw.legend(fontsize=7, loc="lower right")
    ax_lat.legend(fontsize=7, loc="upper left")
    world = sorted({r["world_size"] for r in records})
    devices = sorted({r["device"] for r in records})
    heading = title or f"collectives on {', '.join(map(str, world))} ranks ({', '.join(devices)})"
    if any(r["oversubscribed"] for r in records):
        heading += "  [more ranks than cores: times include the scheduler]"
    fig.suptitle(heading, fontsize=10)
    return fig


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    values = value.flatten().tolist() if hasattr(value, "flatten") else list(value)
    shown = [f"{v:g}" for v in values]
    if len(shown) > 6:  # many ranks: the ends say enough, and the grid stays readable
        shown = shown[:3] + ["..."] + shown[-2:]
    return "[" + " ".join(shown) + "]"


def before_after(per_rank: list[dict]):
    """A grid: one row per operation, each rank's tensor before and after it.

    per_rank: one dict per rank, {operation: (tensor before, tensor after)}, as notebook 01's collectives tour
    returns them; None is drawn '-', meaning the operation leaves that rank's buffer undefined or gives that rank
    nothing.
    """
    import matplotlib.pyplot as plt

    rows = [{"op": op, "before": [seen[op][0] for seen in per_rank], "after": [seen[op][1] for seen in per_rank]}
            for op in per_rank[0]]
    n = len(rows[0]["before"])
    columns = [f"rank {r}\nbefore" for r in range(n)] + [f"rank {r}\nafter" for r in range(n)]
    text = [[_cell(v) for v in row["before"]] + [_cell(v) for v in row["after"]] for row in rows]
    width = max(len(t) for line in text for t in line)
    label_width = max(len(row["op"]) for row in rows)
    font = 8 if n <= 4 else 6
    fig_width = min(18.0, 0.09 * label_width + 2 * n * max(0.9, 0.011 * font * width))
    fig, ax = plt.subplots(figsize=(fig_width, 0.27 * (len(rows) + 2) + 0.4), layout="constrained")
    ax.axis("off")
    left = 0.09 * label_width / fig.get_figwidth()  # room for the row labels, which sit left of the bbox
    table = ax.table(cellText=text, rowLabels=[row["op"] for row in rows], colLabels=columns, cellLoc="center",
                     bbox=[left, 0, 1 - left, 1])
    table.auto_set_font_size(False)
    table.set_fontsize(font)
    for (i, j), cell in table.get_celld().items():
        if i == 0:
            cell.set_facecolor("0.85")
        elif j >= n:
            cell.set_facecolor("#e6f2e6")
        elif j >= 0:
            cell.set_facecolor("#f4f4f4")
    ax.set_title(f"what each of {n} ranks holds before and after each operation (returned by the workers)",
                 fontsize=10)
    return fig


def ring_traffic(measured: dict[str, list[dict]], size_bytes: int):
    """Bytes each rank sent and received in one all-reduce of `size_bytes`, for each method, with closed forms.

    measured: method name -> one dict per rank with 'sent' and 'received' (bytes), as counted by the workers.
    """
    fig, axes = new_figure(len(measured), width=4.4, height=3.4)
    top = max(max(r["sent"], r["received"]) for rows in measured.values() for r in rows) / size_bytes
    for ax, (method, rows) in zip(axes, measured.items()):
        ranks = range(len(rows))
        ax.bar([r - 0.2 for r in ranks], [row["sent"] / size_bytes for row in rows], width=0.4, label="sent")
        ax.bar([r + 0.2 for r in ranks], [row["received"] / size_bytes for row in rows], width=0.4,
               label="received")
        n = len(rows)
        ax.axhline(busbw_factor("all_reduce", n), color="0.3", linestyle="--", linewidth=1, label="2(n-1)/n")
        ax.set_xticks(list(ranks))
        ax.set_xlabel("rank")
        ax.set_ylim(0, top * 1.15)
        ax.set_title(method, fontsize=10)
    axes[0].set_ylabel("bytes / S (S = the tensor's size)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"traffic per rank of one all-reduce, n = {len(next(iter(measured.values())))}", fontsize=10)
    return fig


def explored_point(records: list[dict], point: dict, ceiling: dict | None = None):
    """One re-timed (collective, size), starred on the sweep's busbw and time curves for that collective.

    Why: an explorer's press times one message size; alone, one figure says little. Beside the sweep it shows
    which regime the size falls in (latency-bound at the left, bandwidth-bound at the right) and whether the
    re-timed point agrees with the sweep's. The bars are the interquartile ranges over repeats.
    """
    same = [r for r in records if r["collective"] == point["collective"] and r["backend"] == point["backend"]]
    fig, (ax_bw, ax_lat) = new_figure(2, width=5.2, height=3.4)
    for ax, key, low, high, scale in ((ax_bw, "busbw", "busbw_q1", "busbw_q3", 1 / GB),
                                      (ax_lat, "median_s", "q1_s", "q3_s", 1e6)):
        for rows, style in ((sorted(same, key=lambda r: r["size_bytes"]), {"marker": "o", "color": "C0",
                                                                           "label": "the sweep above"}),
                            ([point], {"marker": "*", "markersize": 12, "color": "C3", "linestyle": "none",
                                       "label": "this press"})):
            if rows:
                mid = [r[key] * scale for r in rows]
                ax.errorbar([r["size_bytes"] for r in rows], mid, capsize=3, **style,
                            yerr=[[m - r[low] * scale for m, r in zip(mid, rows)],
                                  [r[high] * scale - m for m, r in zip(mid, rows)]])
        _size_axis(ax, [r["size_bytes"] for r in same + [point]])
        ax.set_yscale("log")
    if ceiling and ceiling.get("kind") == "bandwidth":
        ax_bw.axhline(ceiling["rate"] / GB, color="0.35", linestyle=":", label=f"ceiling: {ceiling['name']}")
    ax_bw.set_ylabel("busbw (GB/s), median")
    ax_lat.set_ylabel("time per call (us), median")
    ax_bw.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{point['collective']} ({point['backend']}, {point['world_size']} ranks, {point['device']}): "
                 f"{human_bytes(point['size_bytes'])}", fontsize=10)
    return fig


def one_rank(records: list[dict], copy: dict):
    """NCCL on one rank: algbw of the out-of-place collectives (one device copy of S each) against the device copy
    rate (left), and every collective's time per call (right: the in-place ones do nothing, so their time is the
    call's fixed cost at every size). Shaded: the interquartile range over repeats.

    Why not `bandwidth_and_latency`: at world size 1 busbw is 0 or the rate of a call that moves nothing
    (`helpers.measure.collectives.one_rank_rows` says why).
    """
    fig, (ax_bw, ax_lat) = new_figure(2, width=6.4, height=4.2)
    colours = {name: f"C{i}" for i, name in enumerate(COLLECTIVES)}
    for (name, backend), rows in _series([r for r in records if r["world_size"] == 1]).items():
        sizes = [r["size_bytes"] for r in rows]
        in_place = name in IN_PLACE
        kw = {"color": colours[name], "marker": "o", "markersize": 3, "linestyle": ":" if in_place else "-"}
        label = f"{name} ({'in place: nothing' if in_place else 'one copy of S'})"
        if not in_place:
            ax_bw.plot(sizes, [r["size_bytes"] / r["median_s"] / GB for r in rows], label=name, **kw)
            ax_bw.fill_between(sizes, [r["size_bytes"] / r["q3_s"] / GB for r in rows],
                               [r["size_bytes"] / r["q1_s"] / GB for r in rows], color=colours[name], alpha=0.12,
                               linewidth=0)
        ax_lat.plot(sizes, [r["median_s"] * 1e6 for r in rows], label=label, **kw)
        ax_lat.fill_between(sizes, [r["q1_s"] * 1e6 for r in rows], [r["q3_s"] * 1e6 for r in rows],
                            color=colours[name], alpha=0.12, linewidth=0)
    ax_bw.axhline(copy["rate"] / GB, color="0.35", linestyle="--", linewidth=1.2,
                  label=f"ceiling: {copy['name']} of {human_bytes(copy['size_bytes'])}, {copy['rate'] / GB:.3g} GB/s")
    for ax in (ax_bw, ax_lat):
        _size_axis(ax, [r["size_bytes"] for r in records])
        ax.set_yscale("log")
    ax_bw.set_ylabel("algbw S/t (GB/s, 1 GB = 1e9 B), median")
    ax_lat.set_ylabel("time per call (us), median")
    ax_bw.legend(fontsize=7, loc="lower right")
    ax_lat.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"NCCL on one rank ({records[0]['device']}): its copies against the GPU's, and the cost of a call",
                 fontsize=10)
    return fig
