"""Unit tests of helpers.measure.precision: the closed forms are checked against the real torch objects they describe."""
from __future__ import annotations

import pytest
import torch

from helpers.measure import precision as amp_bench

# The workers below run on the GPU where the machine has one. The tests hand them pieces written for the CPU
# (CPU autocast, no caching allocator to empty), so they pin the CPU: the same assertions hold on every machine.
CPU = torch.device("cpu")


def test_scale_trajectory_matches_a_real_gradscaler():
    # Drive torch's GradScaler with gradients we make finite or infinite on purpose, and compare its scale
    # with the closed form at every step.
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    pattern = [True, False, False, False, False, True, False, False, False, True, True, False]
    seen = []
    for overflow in pattern:
        seen.append(scaler.get_scale())
        loss = (w * (float("inf") if overflow else 1.0)).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert seen == amp_bench.scale_trajectory(2.0 ** 10, pattern, growth_interval=3)


def test_scale_trajectory_rules():
    assert amp_bench.scale_trajectory(8.0, [True, True]) == [8.0, 4.0]
    assert amp_bench.scale_trajectory(1.0, [False] * 5, growth_interval=2) == [1.0, 1.0, 2.0, 2.0, 4.0]
    # an overflow restarts the count of clean steps
    assert amp_bench.scale_trajectory(1.0, [False, True, False, False], growth_interval=2) == [1.0, 1.0, 0.5, 0.5]


def test_fp32_matmul_precision_sets_and_restores():
    before = torch.backends.cuda.matmul.fp32_precision
    with amp_bench.fp32_matmul_precision("tf32"):
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        assert torch.backends.cudnn.conv.fp32_precision == "tf32"
    assert torch.backends.cuda.matmul.fp32_precision == before
    with pytest.raises(ValueError):
        with amp_bench.fp32_matmul_precision("high"):
            pass


def test_matmul_flops_is_a_plausible_rate():
    configs = {"fp32": (torch.float32, "ieee"), "bf16": (torch.bfloat16, "ieee")}
    flops = amp_bench.matmul_flops("cpu", configs, 64, 64, 64, min_seconds=0.005, repeats=2)
    assert set(flops) == {"fp32", "bf16"}
    assert all(1e6 < f < 1e15 for f in flops.values()), flops


def test_matmul_error_orders_formats_by_mantissa():
    e32 = amp_bench.matmul_error("cpu", torch.float32, n=64)
    e16 = amp_bench.matmul_error("cpu", torch.float16, n=64)
    eb16 = amp_bench.matmul_error("cpu", torch.bfloat16, n=64)
    assert eb16 > e16 > e32 > 0
    assert e32 < 1e-5 and eb16 < 2.0 ** -6  # bounded by the output rounding of each format, roughly


def test_cpu_low_precision_reports_consistent_facts():
    facts = amp_bench.cpu_low_precision()
    assert facts["capability"] == torch.backends.cpu.get_cpu_capability()
    assert facts["bf16_hardware"] == (facts["avx512_bf16"] or facts["amx_tile"])
    assert facts["tf32_hardware"] is False


def test_amdahl_bound_and_verdicts():
    assert amp_bench.amdahl_bound(4.0) == 4.0 and amp_bench.amdahl_bound(1.2) == 2.0
    assert amp_bench.speedup_verdict(2.5, 2, 3, True).startswith("within the claimed 2-3x; measured 2.50x")
    assert amp_bench.speedup_verdict(3.2, 2, 3, True).startswith("within")  # 10% grace above the high end
    short = amp_bench.speedup_verdict(1.1, 2, 3, True, ceiling=4.0)
    assert short.startswith("below") and "not matmul-bound" in short and "4.00x" in short
    assert "hardware's own matmul gain is below" in amp_bench.speedup_verdict(1.1, 2, 3, True, ceiling=1.5)
    assert amp_bench.speedup_verdict(5.0, 2, 3, True).startswith("above")
    assert amp_bench.speedup_verdict(1.6, 1.5, None, True).startswith("within")
    assert amp_bench.speedup_verdict(2.5, 2, 3, True, ceiling=4.0).count("(") == 0  # no excuse when it holds
    na = amp_bench.speedup_verdict(0.1, 2, 3, False, reason="no unit")
    assert na.startswith("not comparable here: no unit") and "no speed-up claimed" in na


def test_speedup_verdict_passes_the_noise_through():
    straddles = amp_bench.speedup_verdict(2.1, 2, 3, True, spread=(1.8, 2.4))
    assert straddles.startswith("inconclusive") and "1.80-2.40x" in straddles
    assert amp_bench.speedup_verdict(2.5, 2, 3, True, spread=(2.2, 2.8)).startswith("within")
    assert amp_bench.speedup_verdict(1.0, 2, 3, False, spread=(0.9, 1.1), reason="a GPU claim").startswith(
        "not comparable here: a GPU claim")


def test_ratio_with_noise_brackets_the_median():
    r = amp_bench.ratio_with_noise([1.0, 1.2, 1.1, 0.9, 1.3, 1.05])
    assert r["low"] <= r["median"] <= r["high"] and r["median"] == pytest.approx(1.075)


def test_fp32_matmul_precision_falls_back_to_allow_tf32(monkeypatch):
    # A torch without the per-backend fp32_precision settings (as some builds are): the booleans are used.
    class OldCuBLAS:
        allow_tf32 = False

    monkeypatch.setattr(torch.backends.cuda, "matmul", OldCuBLAS())
    with amp_bench.fp32_matmul_precision("tf32"):
        assert torch.backends.cuda.matmul.allow_tf32 is True
    assert torch.backends.cuda.matmul.allow_tf32 is False


def test_time_precisions_trains_every_mode_from_the_same_start():
    torch.manual_seed(0)

    def make_model():
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    def get_batch(g):
        x = torch.randn(32, 8, generator=g)
        return x, (x[:, :4].argmax(dim=1))

    def train_step(model, opt, scaler, x, y, dtype):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return loss.detach()

    modes = {"fp32": {"dtype": torch.float32, "fp32_precision": "ieee"},
             "bf16": {"dtype": torch.bfloat16, "fp32_precision": "ieee"}}
    out = amp_bench.time_precisions(train_step, make_model, get_batch, modes, steps=4, warmup=1,
                                    mlp_shape=(32, 8, 16), ceiling_n=32, device=CPU)
    assert out["losses"]["fp32"][0] == pytest.approx(out["losses"]["bf16"][0], rel=0.05)  # same weights, batch
    assert len(out["times"]["bf16"]) == 3 and out["ratios"]["fp32"] == [1.0] * 3
    assert set(out["flops_square"]) == set(modes) and out["hardware"]["gpu"] is False
    assert amp_bench.cudnn_benchmark_effect([8], device=CPU) is None  # no cuDNN on a CPU


def test_time_precisions_sets_each_modes_fp32_precision_in_the_worker_and_restores_it():
    # What the fp32 baseline ran with is decided inside time_precisions (the worker), not in the kernel: every
    # step of a mode, forward and backward, sees that mode's setting; the process's setting is restored after.
    # The flags are process-wide (ATen's global context), so the CPU sees what a GPU's cuBLAS would read.
    seen = []

    def make_model():
        return torch.nn.Linear(4, 2)

    def get_batch(g):
        return torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)

    def train_step(model, opt, scaler, x, y, dtype):
        at_call = torch.backends.cuda.matmul.fp32_precision
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.register_hook(lambda grad: seen.append(("backward", torch.backends.cuda.matmul.fp32_precision)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        seen.append((at_call, torch.backends.cuda.matmul.fp32_precision))
        return loss.detach()

    before = amp_bench.fp32_settings()
    modes = {"fp32": {"dtype": torch.float32, "fp32_precision": "ieee"},
             "tf32": {"dtype": torch.float32, "fp32_precision": "tf32"}}
    out = amp_bench.time_precisions(train_step, make_model, get_batch, modes, steps=3, warmup=1, mlp_shape=(8, 4, 8),
                                    ceiling_n=8, empty_cache_of="fp32", device=CPU)
    steps = [s for s in seen if s[0] != "backward"]
    assert steps == [("ieee", "ieee"), ("tf32", "tf32")] * 3
    assert [s[1] for s in seen if s[0] == "backward"] == ["ieee", "tf32"] * 3
    assert amp_bench.fp32_settings() == before
    assert set(out["fp32_settings"]["fp32"].values()) == {"ieee"}
    assert set(out["fp32_settings"]["tf32"].values()) == {"tf32"}
    assert out["empty_cache"] is None  # no caching allocator to empty on a CPU


def test_empty_cache_cost_bills_the_emptied_step_itself():
    # The emptying opens the emptied step, inside its timing; the plain step of each pair comes first, so the step
    # after an emptied one is a plain step of the same model (its blocks back in the cache), never another mode's.
    import time

    events = []

    def step():
        events.append("step")

    def empty():
        events.append("empty")
        time.sleep(0.02)

    cost = amp_bench.empty_cache_cost(step, torch.device("cpu"), pairs=4, empty=empty)
    assert events == ["step", "empty", "step"] * 4
    assert len(cost["plain_s"]) == len(cost["emptied_s"]) == 3  # the first pair is the warm-up
    assert all(t >= 0.02 for t in cost["emptied_s"])  # a sleep lasts at least its length: a bound load cannot flip


def test_autocast_tables_on_the_cpu():
    tables = amp_bench.autocast_tables("cpu")
    assert set(tables) == {"cpu bf16", "cpu fp16"}
    assert tables["cpu bf16"]["linear (matmul)"] == "bfloat16" and tables["cpu fp16"]["linear (matmul)"] == "float16"
    assert all(t["parameter"] == t["gradient"] == "float32" for t in tables.values())


def test_grad_scaler_at_work_follows_the_closed_form():
    def make_model():
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    def get_batch(g):
        x = torch.randn(16, 8, generator=g)
        return x, x[:, :4].argmax(dim=1)

    def loss_of(model, x, y, dtype):
        with torch.autocast("cpu", dtype=dtype):
            return torch.nn.functional.cross_entropy(model(x).float(), y)

    grads, log = amp_bench.grad_scaler_at_work(make_model, get_batch, loss_of, steps=12, init_scale=2.0 ** 60,
                                               growth_interval=3, device=CPU)
    assert bool((grads["fp16, no scaler"] == 0).all()) and bool((grads["fp32"] != 0).any())
    overflows = [r["overflow"] for r in log]
    assert overflows[0], "2^60 overflows fp16 at once"
    assert [r["scale"] for r in log] == amp_bench.scale_trajectory(2.0 ** 60, overflows, growth_interval=3)
    assert all(r["updated"] == (not r["overflow"]) for r in log)


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


def test_notebook_05_full_size_gpu_model_has_over_100m_parameters():
    # Issue 13 asks for the speed-up on a model of at least 100M parameters at GPU full size: the parameters cell's
    # GPU_SIZES, built (on the meta device: shapes only) with the GPT and vocabulary of scripts/train_amp.py.
    import importlib.util
    import json

    from helpers.paths import NOTEBOOKS, SCRIPTS

    nb = json.loads((NOTEBOOKS / "05_mixed_precision.ipynb").read_text())
    cell = next(c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", []))
    params: dict = {}
    exec("".join(cell["source"]), params)
    spec = importlib.util.spec_from_file_location("train_amp_for_test", SCRIPTS / "train_amp.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    _, vocab = recipe.char_corpus()
    sizes = params["GPU_SIZES"]
    with torch.device("meta"):
        model = recipe.GPT(vocab, sizes["d_model"], sizes["n_layers"], sizes["n_heads"], sizes["seq_len"])
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


def test_print_speed_claims_prints_one_verdict_per_claim(capsys):
    speedup = {"bf16": _speedup(2.5, 2.2, 2.8), "tf32": _speedup(1.0, 0.9, 1.1)}
    claims = {"AMP bf16: 2-3x": ("bf16", 2, 3, True, "a GPU"), "TF32: 1.5x": ("tf32", 1.5, None, False, "an A100")}
    amp_bench.print_speed_claims(claims, speedup, {"bf16": 4.0, "tf32": 1.0}, "this CPU")
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    verdict = amp_bench.speedup_verdict(2.5, 2, 3, True, 4.0, reason="a GPU; this CPU", spread=(2.2, 2.8))
    assert lines[0] == f"{'AMP bf16: 2-3x':<30}" + verdict
    assert "not comparable here" in lines[1] and "an A100; this CPU" in lines[1]


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


def test_print_empty_cache_cost_reads_the_pairs_as_ratios(capsys):
    amp_bench.print_empty_cache_cost({"mode": "bf16", "plain_s": [1.0] * 5, "emptied_s": [1.5] * 5})
    out = capsys.readouterr().out
    assert out.startswith("empty_cache before every step (bf16, 5 pairs): step time 1.50x of the plain step's")
    assert "noise allows 1.50-1.50x" in out


def test_wire_halving_judges_each_variant_on_counted_bytes():
    from helpers.measure.comm_log import ALL_GATHER, REDUCE_SCATTER

    def comm(gather, scatter):
        return {"comm": {ALL_GATHER: {"bytes": gather}, REDUCE_SCATTER: {"bytes": scatter}}}

    variants = {"DDP, float32 all-reduce": {"hook": {"all-reduce": {"bytes": 400}}},
                "DDP, bfloat16 all-reduce": {"hook": {"all-reduce": {"bytes": 200}}},
                "FSDP2 fp32": comm(800, 400), "FSDP2 bf16 params, fp32 reduce": comm(400, 400)}
    lines = amp_bench.wire_halving(variants, n_params=100).splitlines()
    assert [line.split(" -> ")[1] for line in lines] == ["not reduced: does not hold", "halved: holds",
                                                         "halved: holds", "not reduced: does not hold"]
    assert lines[1] == f"  {'DDP + autocast + bf16 comm hook':<40} 0.50x -> halved: holds"
