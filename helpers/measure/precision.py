"""Measuring mixed precision honestly: what the hardware offers, the matmul ceiling, the tables of a GradScaler run.

Why a module: a speed-up claimed for AMP or TF32 means nothing without the hardware it ran on and without the
ceiling the same hardware sets. A step can gain at most what its matmuls gain (plus up to 2x on memory-bound ops
that move half the bytes), so the notebook measures the matmul throughput per precision in the same run as the
training step and compares the two. Everything here runs in a worker (it may touch CUDA) or on the CPU.
"""
from __future__ import annotations

import statistics
import time

import torch

from helpers.measure import advice
from helpers.devices import synchronize

# Significand bits (stored, without the implicit one) of each format: the closed form of its precision.
MANTISSA_BITS = {"fp32": 23, "tf32": 10, "bf16": 7, "fp16": 10}
EXPONENT_BITS = {"fp32": 8, "tf32": 8, "bf16": 8, "fp16": 5}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_low_precision() -> dict:
    """What this CPU can do in bf16/fp16, asked of torch (and /proc/cpuinfo), not assumed.

    `torch.backends.cpu.get_cpu_capability()` names the widest vector ISA torch dispatches to (AVX2, AVX512, ...),
    but AVX512 alone has no bf16 arithmetic: bf16 matmuls need AVX512_BF16 or AMX; fp16 ones AVX512_FP16 or AMX-FP16.
    Without them autocast converts to fp32 and back around every op and is slower than plain fp32.
    """
    probe = getattr(torch, "cpu", None)

    def ask(name: str, flag: str) -> bool:
        fn = getattr(probe, name, None)
        if callable(fn):
            try:
                return bool(fn())
            except Exception:  # noqa: BLE001 - an old build without the probe
                pass
        return flag in _cpu_flags()

    avx512_bf16 = ask("_is_avx512_bf16_supported", "avx512_bf16")
    amx_tile = ask("_is_amx_tile_supported", "amx_tile")
    amx_fp16 = ask("_is_amx_fp16_supported", "amx_fp16")
    avx512_fp16 = "avx512_fp16" in _cpu_flags()
    return {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "avx512_bf16": avx512_bf16,
        "amx_tile": amx_tile,
        "amx_fp16": amx_fp16,
        "avx512_fp16": avx512_fp16,
        "bf16_hardware": avx512_bf16 or amx_tile,
        "fp16_hardware": amx_fp16 or avx512_fp16,
        "tf32_hardware": False,  # TF32 is a tensor-core format of NVIDIA Ampere and later; no CPU computes in it
    }


def matmul_flops(device, configs: dict[str, tuple[torch.dtype, str]], m: int, k: int, n: int, set_fp32_precision,
                 min_seconds: float = 0.05, max_iters: int = 200, repeats: int = 7, seed: int = 0) -> dict[str, float]:
    """Measured FLOP/s of (m x k) @ (k x n) for each config {name: (dtype, fp32 precision)} on `device`, each burst
    after `set_fp32_precision(precision)`: notebook 05's own switch (its cell), which the worker hands in, so that
    the ceilings and the steps they bound run under the one TF32 setting. It leaves the last config's set.

    A ceiling is what the hardware can do, so each config keeps its best burst; the bursts of all configs are
    interleaved (config A, B, C, then A, B, C again...) so that a neighbour who takes the CPU for a while slows
    every config alike instead of spoiling one. One untimed call per config first (library set-up).
    """
    device = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(seed)
    a32, b32 = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    flops = 2.0 * m * k * n
    operands, iters, best = {}, {}, {}
    for name, (dtype, precision) in configs.items():
        a, b = a32.to(device=device, dtype=dtype), b32.to(device=device, dtype=dtype)
        operands[name] = (a, b, precision)
        set_fp32_precision(precision)
        a @ b
        synchronize(device)
        t0 = time.perf_counter()
        a @ b
        synchronize(device)
        once = max(time.perf_counter() - t0, 1e-7)
        iters[name] = int(min(max_iters, max(1, min_seconds / once)))
        best[name] = 0.0
    for _ in range(repeats):
        for name, (a, b, precision) in operands.items():
            set_fp32_precision(precision)
            synchronize(device)
            t0 = time.perf_counter()
            for _ in range(iters[name]):
                a @ b
            synchronize(device)
            best[name] = max(best[name], flops * iters[name] / (time.perf_counter() - t0))
    return best


def matmul_error(device, dtype: torch.dtype, set_fp32_precision, n: int = 512, precision: str = "ieee",
                 seed: int = 0) -> float:
    """Relative error (max |C - C64| / max |C64|) of one n x n matmul against the same product in float64, after
    `set_fp32_precision(precision)` (see `matmul_flops`)."""
    device = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(seed)
    a64 = torch.randn(n, n, generator=g, dtype=torch.float64)
    b64 = torch.randn(n, n, generator=g, dtype=torch.float64)
    exact = a64 @ b64
    set_fp32_precision(precision)
    c = (a64.to(device=device, dtype=dtype) @ b64.to(device=device, dtype=dtype)).double().cpu()
    return float((c - exact).abs().max() / exact.abs().max())


# ---- Measuring machinery notebook 05's benchmark worker is handed: timing and ceilings (its TF32 switch is its own). ----

def step_seconds(fn, device: torch.device) -> tuple[object, float]:
    """(what `fn()` returned, its seconds): CUDA events on a GPU (the GPU's own clock: the time between two points
    of its stream, whatever the CPU did meanwhile), the wall clock on a CPU; the device idle at both ends."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        result = fn()
        end.record()
        torch.cuda.synchronize(device)
        return result, start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


def ratio_with_noise(ratios) -> dict:
    """{'median', 'low', 'high'}: the median of ratios taken side by side, and the bootstrap interval of it."""
    low, high = advice.median_interval(ratios)
    return {"median": statistics.median(ratios), "low": low, "high": high}


def hardware_formats(device: torch.device) -> dict:
    """Whether `device` computes in bf16, fp16 and TF32 natively (a unit for the format), and its name."""
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        return {"name": torch.cuda.get_device_name(device), "gpu": True, "capability": cap,
                "bf16": cap >= (8, 0), "fp16": cap >= (7, 0), "tf32": cap >= (8, 0)}
    c = cpu_low_precision()
    return {"name": f"CPU {c['capability']}, {torch.get_num_threads()} threads", "gpu": False, "capability": None,
            "bf16": c["bf16_hardware"], "fp16": c["fp16_hardware"], "tf32": False}


def ceilings(device, modes: dict[str, dict], set_fp32_precision, mlp_shape: tuple[int, int, int], ceiling_n: int,
             repeats: int = 7) -> dict:
    """What the hardware itself can do for each mode's format, measured in the worker that times the steps: its
    name and formats (`hardware_formats`), the matmul FLOP/s at the model's MLP shape (tokens, d, 4d) and at a large
    square (`ceiling_n`), each the best of `repeats` interleaved bursts (`matmul_flops`), and the relative error of
    one matmul against float64. Compiled modes share their format's. Each mode's TF32 setting through the worker's
    `set_fp32_precision`, the switch its steps use."""
    device = torch.device(device)
    dtype_of = {n: (m["dtype"], m["fp32_precision"]) for n, m in modes.items() if not m.get("compile")}
    square = (ceiling_n, ceiling_n, ceiling_n)
    return {"hardware": hardware_formats(device),
            "flops_model": matmul_flops(device, dtype_of, *mlp_shape, set_fp32_precision, repeats=repeats),
            "flops_square": matmul_flops(device, dtype_of, *square, set_fp32_precision, repeats=repeats),
            "errors": {n: matmul_error(device, dt, set_fp32_precision, n=256, precision=p)
                       for n, (dt, p) in dtype_of.items()}}


def split_warmup(bench: dict, warmup: int) -> dict:
    """The benchmark worker's per-step seconds ('seconds', every step of every mode) without the first `warmup`
    steps of each mode (compilation, autotuning, the allocator's first blocks) as 'times', each step's ratio to
    the first mode's step of the same round as 'ratios' (a ratio taken side by side), and 'first_step_s'."""
    first = next(iter(bench["seconds"]))
    times = {n: s[warmup:] for n, s in bench["seconds"].items()}
    return {**bench, "times": times, "first_step_s": {n: s[0] for n, s in bench["seconds"].items()},
            "ratios": {n: [a / b for a, b in zip(times[first], t)] for n, t in times.items()}}


def bench_summary(bench: dict, modes: list[str]) -> tuple[dict, dict, dict]:
    """From the benchmark's result (`split_warmup`): (speed-up, ceiling, final loss) per mode. The speed-up over
    the first mode is `ratio_with_noise` of the per-step ratios; the matmul ceiling is its base format's (a mode
    'bf16 + compile' has bf16's); the final loss is the mean of the last 3 steps. Printed as one table, with
    the median step time, the range of the middle 80% of steps, and the first step (compilation included)."""
    speedup = {m: ratio_with_noise(bench["ratios"][m]) for m in modes}
    ceiling = {m: bench["flops_square"][m] / bench["flops_square"]["fp32"] for m in bench["flops_square"]}
    final = {m: sum(bench["losses"][m][-3:]) / 3 for m in modes}
    print(f"{'mode':<20}{'step ms':>9}{'p10-p90 ms':>16}{'first ms':>10}{'speed-up':>10}{'90% interval':>15}"
          f"{'matmul ceiling':>16}{'TFLOP/s':>9}{'final loss':>11}")
    for m in modes:
        base, times = m.split(" + ")[0], sorted(bench["times"][m])
        p10, p90 = times[int(0.1 * (len(times) - 1))], times[int(0.9 * (len(times) - 1))]
        print(f"{m:<20}{statistics.median(times) * 1e3:>9.2f}{p10 * 1e3:>9.2f}-{p90 * 1e3:<6.2f}"
              f"{bench['first_step_s'][m] * 1e3:>10.1f}{speedup[m]['median']:>10.2f}{speedup[m]['low']:>8.2f}-"
              f"{speedup[m]['high']:<6.2f}{ceiling[base]:>16.2f}{bench['flops_square'][base] / 1e12:>9.2f}"
              f"{final[m]:>11.4f}")
    return speedup, ceiling, final


# ---- Tables of what notebook 05's workers return: autocast's dtypes, number formats, GradScaler at work. ----

LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


def print_tables(tables: dict[str, dict[str, str]]) -> None:
    """Tables keyed alike (op -> value) side by side, one column per table."""
    first = next(iter(tables.values()))
    width = max(len(k) for k in first) + 2
    print(f"{'':<{width}}" + "".join(f"{c:>11}" for c in tables))
    for key in first:
        print(f"{key:<{width}}" + "".join(f"{t[key]:>11}" for t in tables.values()))


def print_formats() -> None:
    """fp32, bf16, fp16 as torch.finfo describes them (and TF32, which has no dtype): exponent and mantissa bits,
    machine epsilon, largest value, smallest normal and subnormal."""
    print(f"{'format':<7}{'exp':>4}{'mant':>5}{'eps':>11}{'largest':>11}{'min normal':>12}{'min subnormal':>15}")
    for name, dt in {"fp32": torch.float32, **LOW_PRECISION}.items():
        fi = torch.finfo(dt)
        print(f"{name:<7}{EXPONENT_BITS[name]:>4}{MANTISSA_BITS[name]:>5}{fi.eps:>11.3g}{fi.max:>11.3g}"
              f"{fi.smallest_normal:>12.3g}{fi.smallest_normal * fi.eps:>15.3g}")
    print(f"{'tf32':<7}{8:>4}{10:>5}{2.0 ** -10:>11.3g}   (fp32's range; only inside tensor-core matmuls)")


def scaler_table(grads: dict, log: list[dict], rows: int = 10) -> str:
    """Notebook 05's `grad_scaler_at_work` records as text: per way of computing it, the share of the weight
    gradient that is zero and its largest magnitude; then the first `rows` steps of the GradScaler log (the scale
    as a power of 2)."""
    import math

    lines = [f"{how:<17} weight gradient: {float((g == 0).float().mean()):6.1%} zeros, largest |g| {g.abs().max():.3g}"
             for how, g in grads.items()]
    lines += [f"step {r['step']:>2}  scale 2^{round(math.log2(r['scale'])):<3} overflow {r['overflow']!s:<5} "
              f"weights updated {r['updated']!s:<5} loss {r['loss']:.3f}" for r in log[:rows]]
    return "\n".join(lines)


def wire_rows(variants: dict) -> list[tuple[str, str, int]]:
    """One rank's result of notebook 05's `amp_under_ddp_and_fsdp` as (variant: collective, dtypes, bytes per step)
    rows: the DDP hook's all-reduce, FSDP2's all-gather and reduce-scatter; what `wire_table` prints and
    `plots.precision.collective_bytes` draws."""
    from helpers.measure.comm_log import ALL_GATHER, REDUCE_SCATTER

    return [(f"{name}: {kind}", "/".join(c["dtypes"]).replace("torch.", ""), c["bytes"])
            for name, r in variants.items() for kind, c in (r.get("hook") or r["comm"]).items()
            if kind in ("all-reduce", ALL_GATHER, REDUCE_SCATTER)]


def wire_table(rows: list[tuple[str, str, int]]) -> str:
    """`wire_rows` as one line each: MiB per step and rank, and the dtype on the wire."""
    return "\n".join(f"{label:<46} {nbytes / 2**20:7.3f} MiB per step and rank, {dtype}"
                     for label, dtype, nbytes in rows)


# ---- Printing notebook 05's headlines and targets: one call each, so the notebook keeps its asserts in view.

def warnings_of(fn, category: type[Warning] = Warning) -> list[str]:
    """The messages of the warnings of `category` that calling `fn()` emits, each shown even if shown before (the
    'always' filter): how notebook 05 lets torch itself say that a spelling is deprecated or an argument missing."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if issubclass(w.category, category)]


def print_h100_targets(speedup: dict, targets: dict[str, float], gpu_name: str) -> None:
    """The project's speed-up targets for an H100 ({mode: target x over eager fp32}) as verdicts with their noise,
    never asserted; a mode left out of the run (no `COMPILE`) says so, another GPU is 'not comparable here'."""
    for m, target in targets.items():
        s = speedup.get(m)
        print(f"{m} over eager fp32 (TF32 off), target {target}x on an H100: " + ("not measured (COMPILE=False)" if s
              is None else advice.verdict(s["median"], target, None, unit="x", spread=(s["low"], s["high"]),
                                          applicable=("H100" in gpu_name),
                                          reason=f"the target is for an H100; this GPU: {gpu_name}")))


def headline_speedups(speedup: dict, flops_square: dict, ceiling_n: int) -> None:
    """Headline figures of notebook 05's benchmark: every mode's speed-up over the first (the fp32 baseline), and
    the matmul throughput per format (the ceilings, for docs/measurements.md beside the speed-ups)."""
    from helpers.measure.headline import headline

    for m in list(speedup)[1:]:
        headline(f"{m} step speed-up over fp32", speedup[m]["median"], "x")
    for m, flops in flops_square.items():
        headline(f"{m} matmul throughput, {ceiling_n}³", flops / 1e12, "TFLOP/s")
