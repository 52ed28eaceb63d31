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


def test_tables_lay_out_what_they_are_given():
    ref = {"default": {"losses": [1.0, 2.0], "ref_losses": [1.0, 2.5], "relative_gap": 1e-4,
                       "worst": (3e-5, "blocks.0.self_attn.in_proj_bias", 5)}}
    text = fsdp_plots.reference_table(ref, attention_width=4)
    assert "5.00e-01" in text and "(key part)" in text and text.count("\n") == 1
    column = {"weight_in_forward": "torch.float32", "output": "torch.float32", "sharded": "torch.float32",
              "grad_dtype": "torch.float32", "collectives": {"all_gather": {"bytes": 1024},
                                                             "reduce_scatter": {"bytes": 2048}},
              "state": {"parameters": 1, "gradients": 2, "optimizer": 3}, "activations": 4096, "losses": [3, 2, 1]}
    text = fsdp_plots.precision_table({"fp32": column, "bf16": {**column, "output": "torch.bfloat16"}})
    assert "bfloat16" in text and "1,024" in text and "2.0000" in text and text.count("\n") == 9
    rank = {"rank": 0, "DDP": {"allocated": {"parameters": 4, "gradients": 4, "optimizer": 8}, "activations": 7,
                               "whole_parameters": 0},
            "default": {"allocated": {"parameters": 2, "gradients": 2, "optimizer": 4}, "activations": 7,
                        "whole_parameters": 3}}
    text = fsdp_plots.memory_table([rank, {**rank, "rank": 1}], ["DDP", "default"], psi=1, padding=0)
    assert "16" in text and "padding at N = 2: 0" in text and text.count("\n") == 5
    bench = {"seconds": {"base": [0.002, 0.001, 0.003], "knob": [0.004] * 3, "bad": "failed: X"},
             "ratios": {"base": {}, "knob": {"base": [2.0, 4.0, 4 / 3]}}}
    text = fsdp_plots.step_time_table(bench)
    assert "2.00 [1.00, 3.00]" in text and "2.00x [1.33, 4.00] base" in text and "failed: X" in text
    assert "(baseline)" in text and text.count("\n") == 3


def test_whole_parameters_stack_on_top_of_the_state():
    rows = [{**r, "whole_parameters": 100} if r["strategy"] == "FSDP" else r for r in _rows()]
    fig = fsdp_plots.state_bytes_bars(rows, {1: 1600, 2: 800}, unit=1, unit_name="B")
    assert len(fig.axes[0].patches) == 4 * 3 + 2


def test_anatomy_table_shows_each_ranks_local_shape_beside_the_global_one():
    rank = {"rank": 0, "class": "FSDPNet", "is_original_class": True, "is_FSDPModule": True,
            "moments": {"after fully_shard": ("DTensor", (5, 4), "(Shard(dim=0),)")},
            "params": {"w": ("DTensor", (5, 4), (3, 4), "(Shard(dim=0),)")}}
    text = fsdp_plots.anatomy_table([rank, {**rank, "rank": 1, "params": {"w": ("DTensor", (5, 4), (2, 4), "")}}],
                                    {"w": (5, 4)}, ["w"])
    assert "FSDPNet" in text and "rank 1 local" in text
    assert text.splitlines()[-1].split() == ["w", "(5,", "4)", "(3,", "4)", "(2,", "4)"]
