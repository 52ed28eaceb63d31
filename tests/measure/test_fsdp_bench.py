"""The reading of notebook 03b's world-size-1 bf16 benchmark: ratios taken round by round against the right
baselines, a failed configuration left out, the goal judged on the median's interval. (The worker itself runs in
03b's smoke run on a CPU rank.)"""
from __future__ import annotations

from helpers.measure.fsdp import (COMPILED_BASE, CONFIGS, EAGER_BASE, against_target, base_of, eager_ratios,
                                        with_ratios)


def test_ratios_pair_the_rounds_against_each_baseline_that_ran():
    configs = {EAGER_BASE: {"fsdp": False}, "FSDP2 bf16 policy, defaults": {"fsdp": True},
               COMPILED_BASE: {"fsdp": False, "compile": True},
               "FSDP2 + all three knobs, compiled": {"fsdp": True, "compile": True}}
    bench = {"seconds": {EAGER_BASE: [1.0, 2.0, 4.0], "FSDP2 bf16 policy, defaults": [2.0, 3.0, 4.0],
                         COMPILED_BASE: "failed: RuntimeError: no compiler",
                         "FSDP2 + all three knobs, compiled": [0.5, 1.0, 2.0]}}
    out = with_ratios(bench, configs)
    assert out["ratios"][EAGER_BASE] == {}
    assert out["ratios"]["FSDP2 bf16 policy, defaults"] == {EAGER_BASE: [2.0, 1.5, 1.0]}
    assert out["ratios"]["FSDP2 + all three knobs, compiled"] == {EAGER_BASE: [0.5, 0.5, 0.5]}, "no failed base"
    assert COMPILED_BASE not in out["ratios"], "a failed configuration has no ratios"
    summary = eager_ratios(out)
    assert set(summary) == {"FSDP2 bf16 policy, defaults", "FSDP2 + all three knobs, compiled"}, "FSDP2 rows only"
    r = summary["FSDP2 bf16 policy, defaults"]
    low, high = r["interval"]
    assert r["min"] == 1.0 and r["median"] == 1.5 and r["max"] == 2.0 and r["min"] <= low <= 1.5 <= high <= r["max"]


def test_compiled_configurations_are_compared_at_equal_compilation():
    assert base_of(EAGER_BASE) == [] and base_of(COMPILED_BASE) == [EAGER_BASE]
    compiled = "FSDP2 + all three knobs, compiled"
    assert base_of(compiled) == [EAGER_BASE, COMPILED_BASE]
    assert base_of("FSDP2 + reshard_after_forward=False") == [EAGER_BASE]
    without = {k: v for k, v in CONFIGS.items() if k != COMPILED_BASE}
    assert base_of(compiled, without) == [EAGER_BASE]


def test_a_target_is_judged_on_the_medians_interval():
    assert against_target({"interval": (1.05, 1.15)}, 1.2) == "within 1.2x"
    assert against_target({"interval": (1.25, 1.4)}, 1.2) == "above 1.2x"
    assert against_target({"interval": (1.1, 1.3)}, 1.2).startswith("inconclusive")
