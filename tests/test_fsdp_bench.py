"""The world-size-1 bf16 benchmark of notebook 03b, run on a CPU rank: every knob applies, the rounds interleave,
and the ratios are taken round by round against the right baselines (on a GPU it times tensor cores instead)."""
from __future__ import annotations

from helpers.measure.fsdp_bench import COMPILED_BASE, CONFIGS, EAGER_BASE, against_target, base_of, eager_ratios


def _bench_worker(configs):
    import sys
    import warnings
    from functools import partial
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from helpers.measure.fsdp_bench import bf16_step_times
    from helpers.paths import SCRIPTS

    warnings.filterwarnings("ignore")
    sys.path.insert(0, str(SCRIPTS))
    from train_fsdp import CharTransformer, apply_fsdp, char_corpus, cross_entropy, random_windows, set_prefetch

    tokens, chars = char_corpus()
    recipe = SimpleNamespace(model=partial(CharTransformer, len(chars), 16, 2, n_heads=2, seq_len=8),
                             apply_fsdp=apply_fsdp, set_prefetch=set_prefetch, loss=cross_entropy,
                             batch=partial(random_windows, tokens, seq_len=8))
    dist.init_process_group("gloo")
    try:
        return bf16_step_times(torch.device("cpu"), recipe, 2, repeats=3, warmup=1, configs=configs)
    finally:
        dist.destroy_process_group()


def test_every_eager_knob_applies_and_ratios_pair_the_rounds():
    import helpers

    eager = {label: knobs for label, knobs in CONFIGS.items() if not knobs.get("compile")}
    out = helpers.launch(_bench_worker, eager, world_size=1, timeout=180, quiet=True)[0]
    assert list(out["seconds"]) == list(eager)
    for label, seconds in out["seconds"].items():
        assert isinstance(seconds, list) and len(seconds) == 3 and min(seconds) > 0, (label, seconds)
    assert out["ratios"][EAGER_BASE] == {}
    for label in eager:
        if label != EAGER_BASE:
            expected = [t / b for t, b in zip(out["seconds"][label], out["seconds"][EAGER_BASE])]
            assert out["ratios"][label] == {EAGER_BASE: expected}
    assert out["parameters"] > 0 and out["device"] == "cpu"
    summary = eager_ratios(out)
    assert set(summary) == set(eager) - {EAGER_BASE}, "every FSDP2 configuration, no baseline"
    for label, r in summary.items():
        low, high = r["interval"]
        assert r["min"] <= low <= r["median"] <= high <= r["max"]
        assert sorted(out["ratios"][label][EAGER_BASE])[1] == r["median"]


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
