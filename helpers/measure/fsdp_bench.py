"""What a bf16 `MixedPrecisionPolicy` costs at world size 1 on a GPU, and which FSDP2 knobs win it back: the
configurations notebook 03b's worker `bf16_step_times` times, and the ratios read from its result.

With one GPU FSDP2 shards over a mesh of one rank, so there is no communication, but each block's bf16 weights are
still cast and copied into their unsharded buffers before its forward and, resharded, again before its backward,
its gradients are copied into a reduce-scatter buffer and cast to the reduce dtype, and Adam steps DTensors; plain
`torch.autocast` on the unwrapped model casts per op instead. The knobs (`reshard_after_forward=False`, explicit
prefetch, `torch.compile` per block before `fully_shard`: the recipe's `apply_compile`) are what notebooks 03, 03b
and 05 teach.

How it is timed: every configuration is built and warmed up first (torch.compile compiles during the warm-up, never
inside a timed step); then each round times one step of every configuration in turn, so a slow phase of the
machine falls on all of them alike, and each configuration's ratio to its baseline is taken round by round (a
ratio taken side by side, with its spread). A compiled FSDP2 configuration is compared with the compiled plain
model too: compile speeds both up, and the fair question is what FSDP2 costs at equal compilation. Timings are
shown with their spread and judged only against the project's goal (`against_target`): they depend on the GPU, the
model size and the load.
"""
from __future__ import annotations

EAGER_BASE, COMPILED_BASE = "bf16 autocast, no FSDP", "bf16 autocast + compile, no FSDP"

# label: what is applied. fsdp False: the unwrapped model under torch.autocast; fsdp True: the recipe's apply_fsdp with
# a bf16 param_dtype. The eager FSDP2 rows add one knob each to its defaults; the compiled row adds all of them
# together. Compilation is what costs time on a GPU (each compiled configuration compiles its blocks' forward and
# backward), so there is one compiled FSDP2 row, not one per knob.
CONFIGS = {
    EAGER_BASE: {"fsdp": False},
    "FSDP2 bf16 policy, defaults": {"fsdp": True},
    "FSDP2 + reshard_after_forward=False": {"fsdp": True, "reshard_after_forward": False},
    "FSDP2 + explicit prefetch": {"fsdp": True, "prefetch": True},
    COMPILED_BASE: {"fsdp": False, "compile": True},
    "FSDP2 + all three knobs, compiled": {"fsdp": True, "reshard_after_forward": False, "prefetch": True,
                                          "compile": True},
}


def base_of(label: str, configs: dict = CONFIGS) -> list[str]:
    """The baselines a configuration's step is divided by: the eager autocast step, and for a compiled
    configuration the compiled autocast step as well (when that baseline is among `configs`)."""
    bases = [EAGER_BASE] if label != EAGER_BASE else []
    if configs[label].get("compile") and label != COMPILED_BASE and COMPILED_BASE in configs:
        bases.append(COMPILED_BASE)
    return bases


def with_ratios(bench: dict, configs: dict = CONFIGS) -> dict:
    """Notebook 03b's `bf16_step_times` result with 'ratios': {label: {base: [step / base's step, round by round]}}
    for every configuration that ran, against each of its baselines that ran (`base_of`): ratios taken side by side."""
    seconds = bench["seconds"]
    ratios = {label: {base: [t / b for t, b in zip(seconds[label], seconds[base])]
                      for base in base_of(label, configs) if isinstance(seconds.get(base), list)}
              for label in configs if isinstance(seconds.get(label), list)}
    return {**bench, "ratios": ratios}


def eager_ratios(bench: dict) -> dict[str, dict[str, float | tuple[float, float]]]:
    """Each FSDP2 configuration's step over the plain eager autocast step (`with_ratios`' result; configurations
    that failed are left out): the median, min and max of the rounds' ratios, and the 90% bootstrap interval of the
    median (`advice.median_interval`), the spread a verdict on a target takes."""
    import statistics

    from helpers.measure.advice import median_interval

    out = {}
    for label, by_base in bench["ratios"].items():
        rounds = sorted(by_base.get(EAGER_BASE, []))
        if CONFIGS.get(label, {}).get("fsdp", label.startswith("FSDP")) and rounds:
            out[label] = {"median": statistics.median(rounds), "min": rounds[0], "max": rounds[-1],
                          "interval": median_interval(rounds)}
    return out


def against_target(ratio: dict, target: float) -> str:
    """'within', 'above' or 'inconclusive' for a ratio (`eager_ratios`' entry) against a target ceiling: the median's
    interval decides, so a spread that straddles the target says so instead of picking a side."""
    low, high = ratio["interval"]
    if high <= target:
        return f"within {target}x"
    if low > target:
        return f"above {target}x"
    return f"inconclusive (the interval straddles {target}x)"
