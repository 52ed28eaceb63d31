"""Figures of notebook 06 (distributed checkpoints, fault tolerance): each takes measured results, draws them,
returns the Figure. Nothing here measures."""
from __future__ import annotations

from helpers.plots import new_figure


def save_costs(summary: dict):
    """Left: bytes per second of the disk (write + fsync), each synchronous DCP save and a DCP load, all ranks
    together. Right: how long each save blocks the training loop (a synchronous save all of it; an async save its
    staging), and how long each async save takes until written. `summary` is
    `helpers.measure.disk.summarize_costs`'s."""
    fig, (ax_rate, ax_block) = new_figure(2, width=5.4)
    ops = list(summary["median_s"])
    labels = [op for op in ops if op == "disk write + fsync" or op.startswith("dcp.")]
    ax_rate.barh(range(len(labels)), [summary["rate"][k] / 2.0 ** 20 for k in labels],
                 color=["tab:gray" if k.startswith("disk") else "tab:blue" for k in labels])
    ax_rate.set_yticks(range(len(labels)), labels, fontsize=8)
    ax_rate.invert_yaxis()
    ax_rate.set_xlabel("MiB/s, all ranks together (median)")
    ax_rate.set_title(f"checkpoint of {summary['state_bytes'] / 2 ** 20:.0f} MiB against the disk")
    labels = ["dcp.save"] + [op for op in ops if op.startswith("async_save")]
    ax_block.barh(range(len(labels)), [summary["median_s"][k] * 1e3 for k in labels],
                  color=["tab:red" if k == "dcp.save" else "tab:green" if k.endswith("(blocking)") else "tab:olive"
                         for k in labels])
    ax_block.set_yticks(range(len(labels)), labels, fontsize=8)
    ax_block.invert_yaxis()
    ax_block.set_xlabel("ms (median, slowest rank)")
    ax_block.set_title("a save: what blocks training, and in all")
    return fig


def resumed_trajectory(reference: dict[int, float], attempts: list[dict[int, float]], committed: list[int],
                       failure_step: int | None, title: str):
    """Loss per step of an uninterrupted run, and of each attempt of an interrupted one (drawn over it), with the
    committed checkpoints and the failure marked."""
    fig, (ax,) = new_figure(1, width=8.0, height=3.6)
    steps = sorted(reference)
    ax.plot(steps, [reference[s] for s in steps], color="black", linewidth=3, alpha=0.25,
            label="uninterrupted run")
    markers = ["o", "x", "+", "^"]
    for i, attempt in enumerate(attempts):
        s = sorted(attempt)
        ax.plot(s, [attempt[k] for k in s], linestyle="none", marker=markers[i % len(markers)], markersize=5,
                label=f"attempt {i}" + (" (failed)" if i < len(attempts) - 1 else " (resumed)"))
    for j, step in enumerate(committed):
        ax.axvline(step, color="tab:green", linestyle=":", linewidth=1,
                   label="committed checkpoint" if j == 0 else None)
    if failure_step is not None:
        ax.axvline(failure_step, color="tab:red", linewidth=1.5, label="failure")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (rank 0)")
    ax.set_title(title)
    ax.legend(fontsize=8, ncol=2)
    return fig
