"""Unit tests of helpers.measure.precision: the closed forms are checked against the real torch objects they describe."""
from __future__ import annotations

import pytest
import torch

from helpers.measure import precision as amp_bench

# Notebook 05's benchmark worker picks the GPU where there is one; the machinery it is handed takes its device as an
# argument, and these tests name the CPU: the same assertions hold on a machine with or without a GPU.
CPU = torch.device("cpu")


def test_matmul_flops_is_a_plausible_rate_and_sets_each_configs_precision_before_its_bursts():
    configs = {"fp32": (torch.float32, "ieee"), "tf32": (torch.float32, "tf32"), "bf16": (torch.bfloat16, "ieee")}
    asked = []
    flops = amp_bench.matmul_flops("cpu", configs, 64, 64, 64, asked.append, min_seconds=0.005, repeats=2)
    assert set(flops) == set(configs)
    assert all(1e6 < f < 1e15 for f in flops.values()), flops
    assert asked == ["ieee", "tf32", "ieee"] * 3, "a probe per config, then each of the 2 rounds, in order"


def test_matmul_error_orders_formats_by_mantissa():
    e32, e16, eb16 = (amp_bench.matmul_error("cpu", dtype, lambda precision: None, n=64)
                      for dtype in (torch.float32, torch.float16, torch.bfloat16))
    assert eb16 > e16 > e32 > 0
    assert e32 < 1e-5 and eb16 < 2.0 ** -6  # bounded by the output rounding of each format, roughly


def test_cpu_low_precision_reports_consistent_facts():
    facts = amp_bench.cpu_low_precision()
    assert facts["capability"] == torch.backends.cpu.get_cpu_capability()
    assert facts["bf16_hardware"] == (facts["avx512_bf16"] or facts["amx_tile"])
    assert facts["tf32_hardware"] is False


def test_ratio_with_noise_brackets_the_median():
    r = amp_bench.ratio_with_noise([1.0, 1.2, 1.1, 0.9, 1.3, 1.05])
    assert r["low"] <= r["median"] <= r["high"] and r["median"] == pytest.approx(1.075)


def test_bench_summary_takes_medians_of_side_by_side_ratios(capsys):
    bench = {"ratios": {"fp32": [1.0, 1.0, 1.0], "bf16": [2.0, 3.0, 10.0]},
             "times": {"fp32": [0.3, 0.2, 0.1], "bf16": [0.1, 0.05, 0.02]},
             "first_step_s": {"fp32": 1.0, "bf16": 1.0},
             "flops_square": {"fp32": 1e12, "bf16": 4e12},
             "losses": {"fp32": [3.0, 2.0, 1.0, 1.0, 1.0], "bf16": [3.0, 2.0, 1.0, 1.5, 2.0]}}
    speedup, ceiling, final = amp_bench.bench_summary(bench, ["fp32", "bf16"])
    assert speedup["bf16"]["median"] == 3.0 and speedup["bf16"]["low"] <= 3.0 <= speedup["bf16"]["high"]
    assert ceiling == {"fp32": 1.0, "bf16": 4.0} and final == {"fp32": 1.0, "bf16": 1.5}
    assert "bf16" in capsys.readouterr().out


def test_scaler_table_shows_zero_share_and_the_scale_as_a_power_of_two():
    grads = {"fp32": torch.tensor([1.0, -2.0]), "fp16, no scaler": torch.zeros(2)}
    log = [{"step": s, "scale": 2.0 ** (24 - s), "overflow": True, "updated": False, "loss": 4.5} for s in range(12)]
    lines = amp_bench.scaler_table(grads, log, rows=3).splitlines()
    assert len(lines) == 2 + 3
    assert lines[0] == "fp32              weight gradient:   0.0% zeros, largest |g| 2"
    assert "100.0% zeros" in lines[1]
    assert lines[3] == "step  1  scale 2^23  overflow True  weights updated False loss 4.500"


def test_wire_rows_take_the_hook_for_ddp_and_the_collective_log_for_fsdp():
    from helpers.measure.comm_log import ALL_GATHER, REDUCE_SCATTER

    variants = {"DDP, bfloat16 all-reduce": {"hook": {"all-reduce": {"bytes": 2048, "dtypes": ["torch.bfloat16"]}},
                                             "comm": {"broadcast": {"bytes": 1, "dtypes": ["torch.float32"]}}},
                "FSDP2 fp32": {"comm": {ALL_GATHER: {"bytes": 4096, "dtypes": ["torch.float32"]},
                                        REDUCE_SCATTER: {"bytes": 1024, "dtypes": ["torch.float32"]},
                                        "broadcast": {"bytes": 1, "dtypes": ["torch.float32"]}}}}
    rows = amp_bench.wire_rows(variants)
    assert rows == [("DDP, bfloat16 all-reduce: all-reduce", "bfloat16", 2048),
                    (f"FSDP2 fp32: {ALL_GATHER}", "float32", 4096), (f"FSDP2 fp32: {REDUCE_SCATTER}", "float32", 1024)]
    assert amp_bench.wire_table(rows[:1]) == f"{rows[0][0]:<46}   0.002 MiB per step and rank, bfloat16"


def test_notebook_05_full_size_gpu_model_has_over_100m_parameters(monkeypatch):
    # The GPU speed-up is wanted on a model of at least 100M parameters at full size: the parameters cell's
    # GPU_SIZES, built (on the meta device: shapes only) as the notebook builds it (the recipe's preset "tiny" at
    # those sizes, on its 256 byte tokens).
    import json

    from helpers.paths import NOTEBOOKS, SCRIPTS

    nb = json.loads((NOTEBOOKS / "05_mixed_precision.ipynb").read_text())
    cell = next(c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", []))
    params: dict = {}
    exec("".join(cell["source"]), params)
    monkeypatch.syspath_prepend(str(SCRIPTS / "train"))
    from config import preset
    from model import Llama

    sizes = params["GPU_SIZES"]
    cfg = preset("tiny", vocab_size=256, dim=sizes["dim"], n_layers=sizes["n_layers"], n_heads=sizes["n_heads"],
                 n_kv_heads=sizes.get("n_kv_heads"), max_seq_len=sizes["seq_len"])
    with torch.device("meta"):
        model = Llama(cfg)
    assert sum(p.numel() for p in model.parameters()) >= 100e6


def test_warnings_of_returns_the_messages_of_one_category_each_time():
    import warnings

    def warn():
        warnings.warn("old name", FutureWarning)
        warnings.warn("other", UserWarning)

    assert amp_bench.warnings_of(warn, FutureWarning) == ["old name"]
    assert amp_bench.warnings_of(warn, FutureWarning) == ["old name"], "shown again: the 'always' filter"
    assert amp_bench.warnings_of(warn) == ["old name", "other"]


def _speedup(median, low, high):
    return {"median": median, "low": low, "high": high}


def test_print_h100_targets_says_what_was_not_measured_and_where_it_applies(capsys):
    amp_bench.print_h100_targets({"bf16": _speedup(5.0, 4.8, 5.2)}, {"bf16": 4.5, "bf16 + compile": 6.5},
                                 "NVIDIA A100-SXM4-80GB")
    first, second = capsys.readouterr().out.splitlines()
    assert first.startswith("bf16 over eager fp32 (TF32 off), target 4.5x on an H100: ")
    assert "not comparable here" in first and "A100" in first
    assert second == "bf16 + compile over eager fp32 (TF32 off), target 6.5x on an H100: not measured (COMPILE=False)"
    amp_bench.print_h100_targets({"bf16": _speedup(5.0, 4.8, 5.2)}, {"bf16": 4.5}, "NVIDIA H100 80GB HBM3")
    assert "not comparable" not in capsys.readouterr().out


def test_headline_speedups_skips_the_baseline_and_reports_every_ceiling(capsys):
    speedup = {"fp32": _speedup(1.0, 1.0, 1.0), "bf16": _speedup(2.0, 1.9, 2.1)}
    amp_bench.headline_speedups(speedup, {"fp32": 1e12, "bf16": 4e12}, 384)
    assert capsys.readouterr().out.splitlines() == ["bf16 step speed-up over fp32: 2 x",
                                                    "fp32 matmul throughput, 384³: 1 TFLOP/s",
                                                    "bf16 matmul throughput, 384³: 4 TFLOP/s"]


def test_ceilings_measure_every_eager_format_on_the_named_device():
    modes = {"fp32": {"dtype": torch.float32, "fp32_precision": "ieee"},
             "bf16": {"dtype": torch.bfloat16, "fp32_precision": "ieee"},
             "bf16 + compile": {"dtype": torch.bfloat16, "fp32_precision": "ieee", "compile": True}}
    asked = []
    out = amp_bench.ceilings(CPU, modes, asked.append, mlp_shape=(16, 8, 32), ceiling_n=32)
    assert set(asked) == {"ieee"}, "every eager format's own setting, through the worker's switch"
    assert out["hardware"]["gpu"] is False
    assert set(out["flops_model"]) == set(out["flops_square"]) == set(out["errors"]) == {"fp32", "bf16"}
    assert out["errors"]["bf16"] > out["errors"]["fp32"]


def test_split_warmup_pairs_each_step_with_the_first_modes_step_of_its_round():
    bench = {"seconds": {"fp32": [9.0, 2.0, 4.0], "bf16": [7.0, 1.0, 1.0]}, "losses": {}}
    out = amp_bench.split_warmup(bench, warmup=1)
    assert out["times"] == {"fp32": [2.0, 4.0], "bf16": [1.0, 1.0]}
    assert out["ratios"] == {"fp32": [1.0, 1.0], "bf16": [2.0, 4.0]}
    assert out["first_step_s"] == {"fp32": 9.0, "bf16": 7.0}
