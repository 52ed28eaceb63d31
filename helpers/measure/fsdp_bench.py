"""What a bf16 `MixedPrecisionPolicy` costs at world size 1 on a GPU, and which FSDP2 knobs win it back.

Why a benchmark here and not in the notebook: with one GPU FSDP2 shards over a mesh of one rank, so there is no
communication, but each block's bf16 weights are still cast and copied into their unsharded buffers before its
forward and, resharded, again before its backward, its gradients are copied into a reduce-scatter buffer and cast
to the reduce dtype, and Adam steps DTensors; plain `torch.autocast` on the unwrapped model casts per op instead.
The timing loop, its warm-up and the repeats are machinery; the knobs (`reshard_after_forward=False`, explicit
prefetch, `torch.compile` per block before `fully_shard`) are what notebooks 03 and 03b teach.

How it is timed: every configuration is built and warmed up first (torch.compile compiles during the warm-up, never
inside a timed step); then each round times one step of every configuration in turn, so a slow phase of the
machine falls on all of them alike, and each configuration's ratio to its baseline is taken round by round (a
ratio taken side by side, with its spread). A compiled FSDP2 configuration is compared with the compiled plain
model too: compile speeds both up, and the fair question is what FSDP2 costs at equal compilation. Timings are
shown with their spread and judged by nothing here: they depend on the GPU, the model size and the load.
"""
from __future__ import annotations

import torch

from helpers.measure.timing import timed

EAGER_BASE, COMPILED_BASE = "bf16 autocast, no FSDP", "bf16 autocast + compile, no FSDP"

# label: what is applied. fsdp False: the unwrapped model under torch.autocast. The eager FSDP2 rows add one knob each
# to the defaults; the compiled row adds all of them together. Compilation is what costs time on a GPU (each compiled
# configuration compiles its blocks' forward and backward), so there is one compiled FSDP2 row, not one per knob.
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


def bf16_step_times(device, recipe, per_rank_batch: int, repeats: int, warmup: int = 3,
                    configs: dict | None = None) -> dict:
    """Seconds per training step for each of `configs` (default `CONFIGS`), interleaved, and the round-by-round
    ratios to each configuration's baselines (`base_of`). A configuration that raised is reported as its error.

    `recipe` is notebook 03b's namespace: `model()`, `apply_fsdp(model, mesh, **kw)`, `set_prefetch(model)`,
    `loss(logits, y)`, `batch(n, generator=g)`. Runs in a worker (meant for one GPU; runs on a CPU too, where
    autocast is the CPU's and the figures say nothing about tensor cores). Returns plain values:
    {'seconds': {label: [s, ...] or 'failed: ...'}, 'ratios': {label: {base: [r, ...]}}, 'parameters': n,
    'device': str, 'setup_s': {label: seconds to build and warm up (compilation included)}}.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    configs = CONFIGS if configs is None else configs
    # Each compiled block is a cache entry of one code object (nn.Module._call_impl); plain and FSDP2 blocks, each
    # configuration's, must not exhaust dynamo's default limit of 8 and fall back to eager silently.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    x, y = (t.to(device) for t in recipe.batch(per_rank_batch, generator=torch.Generator().manual_seed(0)))

    def make_step(knobs: dict):
        torch.manual_seed(0)
        model = recipe.model().to(device)
        if knobs.get("compile"):                        # per block, before fully_shard: torchtitan's order
            for block in model.blocks:
                block.compile()
        if knobs["fsdp"]:
            recipe.apply_fsdp(model, mesh, mp_policy=mp,
                              **{k: v for k, v in knobs.items() if k == "reshard_after_forward"})
            if knobs.get("prefetch"):
                recipe.set_prefetch(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)

        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=not knobs["fsdp"]):
                logits = model(x)
            recipe.loss(logits, y).backward()
            opt.step()
            opt.zero_grad()
        return step

    import time

    seconds, steps, setup_s = {}, {}, {}
    for label, knobs in configs.items():
        try:
            t0 = time.perf_counter()
            steps[label] = make_step(knobs)
            for _ in range(warmup):                     # compiles here, outside the timed steps
                steps[label]()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            setup_s[label] = time.perf_counter() - t0   # what a configuration costs before its first timed step
            seconds[label] = []
        except Exception as exc:  # noqa: BLE001 - a knob this torch lacks is shown, not fatal
            steps.pop(label, None)
            seconds[label] = f"failed: {type(exc).__name__}: {str(exc)[:160]}"
    for _ in range(repeats):                            # interleaved: each round times every configuration once
        for label in list(steps):
            try:
                seconds[label].append(timed(steps[label], device)[1])
            except Exception as exc:  # noqa: BLE001
                steps.pop(label)
                seconds[label] = f"failed: {type(exc).__name__}: {str(exc)[:160]}"
    ratios = {label: {base: [t / b for t, b in zip(seconds[label], seconds[base])]
                      for base in base_of(label, configs) if isinstance(seconds.get(base), list)}
              for label in configs if isinstance(seconds[label], list)}
    with torch.device("meta"):
        parameters = sum(p.numel() for p in recipe.model().parameters())
    return {"seconds": seconds, "ratios": ratios, "parameters": parameters, "device": str(device),
            "setup_s": setup_s}


def eager_ratios(bench: dict) -> dict[str, dict[str, float | tuple[float, float]]]:
    """Each FSDP2 configuration's step over the plain eager autocast step (`bf16_step_times`' result; configurations
    that failed are left out): the median, min and max of the rounds' ratios, and the 90% bootstrap interval of the
    median (`claims.median_interval`), the spread a verdict on a target takes."""
    import statistics

    from helpers.measure.claims import median_interval

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
