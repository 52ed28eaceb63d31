"""The FSDP figures draw what they are given (one bar segment per measured part), and nothing else."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from helpers.plots import fsdp as fsdp_plots  # noqa: E402


def _rows():
    rows = []
    for n in (1, 2):
        for strategy, div in (("DDP", 1), ("FSDP", n)):
            rows.append({"strategy": strategy, "world_size": n, "parameters": 400 / div, "gradients": 400 / div,
                         "optimizer": 800 / div, "activations": 1000})
    return rows


def test_state_bytes_bars_stack_three_parts_per_bar_and_mark_zero():
    fig = fsdp_plots.state_bytes_bars(_rows(), {1: 1600, 2: 800}, unit=1, unit_name="B")
    state_ax, act_ax = fig.axes
    assert len(state_ax.patches) == 4 * 3 and len(act_ax.patches) == 4
    tops = {round(p.get_y() + p.get_height()) for p in state_ax.patches}
    assert {1600, 800} <= tops and max(tops) == 1600  # DDP's 16 bytes-worth at both N, FSDP's halved at N=2
    assert len(state_ax.lines) == 2  # one ZeRO tick per FSDP bar


def test_collective_bars_and_loss_curve():
    fig = fsdp_plots.collective_bars({"DDP": {"all_reduce": {"calls": 2, "ring_bytes": 10.0}},
                                      "FSDP": {"all_gather": {"calls": 5, "ring_bytes": 8.0},
                                               "reduce_scatter": {"calls": 3, "ring_bytes": 5.0}}}, unit=1)
    assert len(fig.axes[0].patches) == 3
    fig = fsdp_plots.loss_curve([4.0 - 0.1 * i for i in range(20)], {"ln V": 4.6}, window=5)
    lines = fig.axes[0].lines
    assert len(lines[0].get_xdata()) == 20 and len(lines[1].get_xdata()) == 16
