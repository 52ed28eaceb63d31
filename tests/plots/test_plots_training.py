"""helpers.plots.training: every figure draws what it is given (one artist per run, bar or point)."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from helpers.plots import training  # noqa: E402
from helpers.measure.timing import summarize  # noqa: E402


def test_loss_curves_draws_raw_and_smoothed_line_per_run():
    fig = training.loss_curves({"a": [2.0, 1.0, 0.5, 0.4], "b": [2.2, 1.5, 0.9, 0.3]}, window=2)
    ax = fig.axes[0]
    assert len(ax.lines) == 4 and ax.get_yscale() == "log"
    assert list(ax.lines[0].get_ydata()) == pytest.approx([2.0, 1.5, 0.75, 0.45])  # trailing mean of 2


def test_accuracy_curves_two_views():
    fig = training.accuracy_curves({"x": {"acc": [0.5, 0.9], "steps": [10, 20]},
                                    "y": {"acc": [0.3, 0.8], "steps": [2, 4]}})
    by_epoch, by_step = fig.axes
    assert len(by_epoch.lines) == len(by_step.lines) == 2
    assert list(by_step.lines[1].get_xdata()) == [2, 4]


def test_bucket_sweep_plots_counted_and_predicted():
    rows = [{"cap": c, "buckets": [1] * n, "sync": summarize([0.009, 0.01, 0.012]),
             "local": summarize([0.004, 0.005, 0.006])} for c, n in ((0.1, 4), (None, 2), (25, 1))]
    fig = training.bucket_sweep(rows, [4, 2, 1])
    calls, times = fig.axes
    assert list(calls.lines[1].get_ydata()) == [4, 2, 1]
    assert [t.get_text() for t in calls.get_xticklabels()] == ["0.1", "default", "25"]
    assert len(times.containers) == 2  # two error-bar series
    assert list(times.containers[0].lines[0].get_ydata()) == [10.0] * 3  # the medians, in ms


def test_compression_skips_unsupported_methods():
    rows = [{"method": "allreduce", "bytes_per_step": 4e6, "accuracy": 0.95, "step_s": 0.01},
            {"method": "bf16", "supported": False, "reason": "no"},
            {"method": "PowerSGD r=1", "bytes_per_step": 1e5, "accuracy": 0.9, "step_s": 0.012}]
    fig = training.compression(rows)
    assert [len(ax.patches) for ax in fig.axes] == [2, 2, 2]


def test_zero_memory_one_stack_per_rank_and_setup():
    held = {"parameters": 4e6, "gradients": 4e6, "optimizer": 8e6}
    fig = training.zero_memory({"DDP": [held, held], "ZeRO-1": [dict(held, optimizer=4e6)] * 2},
                               {"DDP": 16e6, "ZeRO-1": 12e6})
    assert len(fig.axes[0].patches) == 4 * 3


def test_scaling_efficiency_and_refusal():
    rows = [{"world_size": 1, "samples_per_s": 100.0}, {"world_size": 2, "samples_per_s": 150.0}]
    fig = training.scaling(rows, warn_above=1)
    thr, eff = fig.axes
    assert list(eff.lines[0].get_ydata()) == [1.0, 0.75]
    assert list(thr.lines[1].get_ydata()) == [100.0, 200.0]
    with pytest.raises(ValueError):
        training.scaling([{"world_size": 1, "samples_per_s": float("nan")}])


def test_bucket_sweep_takes_raw_step_times_too():
    rows = [{"cap": c, "buckets": [1] * n, "sync": [0.009, 0.01, 0.012], "local": [0.004, 0.005, 0.006]}
            for c, n in ((0.1, 4), (None, 2))]
    times = training.bucket_sweep(rows, [4, 2]).axes[1]
    assert list(times.containers[0].lines[0].get_ydata()) == [10.0] * 2


def test_compression_without_step_times_draws_two_panels():
    rows = [{"method": "allreduce", "bytes_per_step": 4e6, "accuracy": 0.95},
            {"method": "fp16", "bytes_per_step": 2e6, "accuracy": 0.95}]
    assert [len(ax.patches) for ax in training.compression(rows).axes] == [2, 2]


def test_overlap_timeline_draws_two_rows_of_spans_per_rank():
    measured = [{"compute_intervals": [(100.0, 300.0)], "comm_intervals": [(250.0, 400.0), (450.0, 500.0)]},
                {"compute_intervals": [(0.0, 50.0)], "comm_intervals": []}]
    fig = training.overlap_timeline(measured)
    ax = fig.axes[0]
    assert len(ax.collections) == 4 and len(ax.get_yticks()) == 4
    spans = ax.collections[1].get_paths()  # rank 0's communication, in ms from its first span
    assert len(spans) == 2 and spans[0].get_extents().x0 == pytest.approx(0.15)
