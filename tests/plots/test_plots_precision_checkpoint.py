"""The figures of notebooks 05 and 06 draw what they are given (no measuring inside), on any backend."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from helpers.plots import checkpoint, precision  # noqa: E402

MODES = ["fp32", "tf32", "bf16", "fp16"]


def test_precision_figures():
    modes = MODES + ["bf16 + compile"]
    bench = {"losses": {m: [3.0, 2.5, 2.0] for m in modes}, "flops_model": dict.fromkeys(MODES, 2.0),
             "flops_square": dict.fromkeys(MODES, 3.0), "hardware": {"name": "test"}}
    speedup = {m: {"median": 1.0, "low": 0.9, "high": 1.2} for m in modes}
    fig = precision.precision_comparison(bench, speedup, modes)
    assert len(fig.axes) == 3
    assert len(fig.axes[0].lines) == 5 and len(fig.axes[1].lines) == 5  # 4 differences + the zero line
    log = [{"step": i, "scale": 2.0 ** (10 - i), "overflow": i < 2, "loss": 1.0} for i in range(5)]
    assert len(precision.scaler_trajectory(log, 3).axes) == 2
    ac = {"saved_bytes": {"none": 4e6, "full": 1e6, "selective": 1e6}, "n_layers": 4, "peak_label": "peak",
          "held_bytes": {"none": 4e6, "full": 1e6, "selective": 2.5e6},
          "peak_bytes": {"none": 5e6, "full": 2e6, "selective": 3e6},
          "step_ms": {"none": 10.0, "full": 13.0, "selective": 11.0}}
    fig = precision.activation_checkpointing(ac)
    assert len(fig.axes) == 2 and len(fig.axes[0].patches) == 3 * 3 and len(fig.axes[1].patches) == 3
    assert fig.axes[0].patches[3 + 2].get_height() == 2.5e6 / 2 ** 20  # held bytes, selective
    rows = [("DDP: all-reduce", "float32", 4e6), ("FSDP: all-gather", "bfloat16", 2e6)]
    fig = precision.collective_bytes(rows, "t")
    assert [p.get_width() for p in fig.axes[0].patches] == [4e6 / 2 ** 20, 2e6 / 2 ** 20]
    fig = precision.float8_losses({"bf16": [3.0, 2.0], "tensorwise": [3.1, 2.0], "rowwise": [2.9, 2.5]})
    assert len(fig.axes[0].lines) == 3 and len(fig.axes[1].lines) == 3   # 2 differences + the zero line
    assert list(fig.axes[1].lines[1].get_ydata()) == [2.9 - 3.0, 2.5 - 2.0]   # rowwise minus bf16


def test_checkpoint_figures():
    from helpers.measure.disk import summarize_costs

    ops = ("disk write + fsync", "dcp.save", "async_save, default stager (blocking)",
           "async_save, default stager (until written)", "dcp.load")
    times = dict(zip(ops, ([0.1, 0.12], [0.2, 0.25], [0.02, 0.03], [0.22, 0.3], [0.05, 0.06])))
    summary = summarize_costs([{"times": times, "held_bytes": 2 ** 24, "on_disk": 2 ** 24 + 4096, "device": "cpu"}])
    fig = checkpoint.save_costs(summary)
    assert len(fig.axes) == 2 and len(fig.axes[0].patches) == 3 and len(fig.axes[1].patches) == 3
    assert fig.axes[0].patches[0].get_width() == 2 ** 24 / 0.11 / 2 ** 20  # the disk's median rate, in MiB/s
    ref = {s: 4.0 - s / 10 for s in range(1, 21)}
    fig = checkpoint.resumed_trajectory(ref, [{s: ref[s] for s in range(1, 16)}, {s: ref[s] for s in range(11, 21)}],
                                        [10], 15, "t")
    assert len(fig.axes[0].lines) == 1 + 2 + 1 + 1  # reference, two attempts, a checkpoint, the failure
