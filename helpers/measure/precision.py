"""Measuring mixed precision honestly: what the hardware offers, the matmul ceiling, GradScaler's arithmetic.

Why a module: a speed-up claimed for AMP or TF32 means nothing without the hardware it ran on and without the
ceiling the same hardware sets. A step can gain at most what its matmuls gain (plus up to 2x on memory-bound ops
that move half the bytes), so the notebook measures the matmul throughput per precision in the same run as the
training step and compares the two. Everything here runs in a worker (it may touch CUDA) or on the CPU.
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch

from helpers.measure import claims
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


def _tf32_settings() -> list[tuple[object, str]]:
    """(settings object, attribute) pairs that choose TF32 or true fp32, whichever this torch has.

    torch >= 2.9 has per-backend `fp32_precision` ("ieee" / "tf32") on `torch.backends.cuda.matmul` (cuBLAS),
    `torch.backends.cudnn.conv` and `torch.backends.mkldnn.matmul` (oneDNN, CPU); older builds (and any build
    that lacks one of them) have the boolean `allow_tf32` on `torch.backends.cuda.matmul` and `torch.backends.cudnn`.
    """
    found = []
    cudnn_conv = getattr(torch.backends.cudnn, "conv", None)
    for new_home, old_home in ((torch.backends.cuda.matmul, torch.backends.cuda.matmul),
                               (cudnn_conv, torch.backends.cudnn)):
        if new_home is not None and hasattr(new_home, "fp32_precision"):
            found.append((new_home, "fp32_precision"))
        elif hasattr(old_home, "allow_tf32"):
            found.append((old_home, "allow_tf32"))
    mkldnn_matmul = getattr(torch.backends.mkldnn, "matmul", None)
    if mkldnn_matmul is not None and hasattr(mkldnn_matmul, "fp32_precision"):
        found.append((mkldnn_matmul, "fp32_precision"))
    return found


@contextlib.contextmanager
def fp32_matmul_precision(precision: str):
    """Run fp32 matmuls as 'ieee' (true fp32) or 'tf32', with whichever setting this torch has.

    `torch.backends.cuda.matmul.fp32_precision` (cuBLAS) and `torch.backends.cudnn.conv.fp32_precision` replaced
    `allow_tf32` and `torch.set_float32_matmul_precision('high')` in torch 2.9; where they are missing the
    `allow_tf32` booleans are set instead. The previous values are restored on exit.
    """
    if precision not in ("ieee", "tf32"):
        raise ValueError(f"precision must be 'ieee' or 'tf32', not {precision!r}")
    settings = _tf32_settings()
    old = [getattr(home, name) for home, name in settings]
    try:
        for home, name in settings:
            setattr(home, name, precision if name == "fp32_precision" else precision == "tf32")
        yield
    finally:
        for (home, name), value in zip(settings, old):
            setattr(home, name, value)


def matmul_flops(device, configs: dict[str, tuple[torch.dtype, str]], m: int, k: int, n: int,
                 min_seconds: float = 0.05, max_iters: int = 200, repeats: int = 7, seed: int = 0) -> dict[str, float]:
    """Measured FLOP/s of (m x k) @ (k x n) for each config {name: (dtype, fp32 precision)} on `device`.

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
        with fp32_matmul_precision(precision):
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
            with fp32_matmul_precision(precision):
                synchronize(device)
                t0 = time.perf_counter()
                for _ in range(iters[name]):
                    a @ b
                synchronize(device)
                best[name] = max(best[name], flops * iters[name] / (time.perf_counter() - t0))
    return best


def matmul_error(device, dtype: torch.dtype, n: int = 512, precision: str = "ieee", seed: int = 0) -> float:
    """Relative error (max |C - C64| / max |C64|) of one n x n matmul against the same product in float64."""
    device = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(seed)
    a64 = torch.randn(n, n, generator=g, dtype=torch.float64)
    b64 = torch.randn(n, n, generator=g, dtype=torch.float64)
    exact = a64 @ b64
    with fp32_matmul_precision(precision):
        c = (a64.to(device=device, dtype=dtype) @ b64.to(device=device, dtype=dtype)).double().cpu()
    return float((c - exact).abs().max() / exact.abs().max())


def scale_trajectory(init_scale: float, found_inf: list[bool], growth_factor: float = 2.0,
                     backoff_factor: float = 0.5, growth_interval: int = 2000) -> list[float]:
    """The loss scale GradScaler uses at each step, in closed form, given which steps overflowed.

    The rule of `GradScaler.update`: an overflow multiplies the scale by `backoff_factor` and restarts the count;
    `growth_interval` consecutive clean steps multiply it by `growth_factor`. Returns one scale per step (the
    one that step's loss was multiplied by), so it can be compared with what the real scaler did.
    """
    scales, scale, clean = [], float(init_scale), 0
    for overflow in found_inf:
        scales.append(scale)
        if overflow:
            scale *= backoff_factor
            clean = 0
        else:
            clean += 1
            if clean == growth_interval:
                scale *= growth_factor
                clean = 0
    return scales


def amdahl_bound(matmul_speedup: float, memory_speedup: float = 2.0) -> float:
    """The most a whole step can gain when its matmuls gain `matmul_speedup` and everything else at most
    `memory_speedup` (half the bytes moved): a weighted harmonic mean never exceeds its largest term."""
    return max(matmul_speedup, memory_speedup)


def speedup_verdict(measured: float, claimed_low: float, claimed_high: float | None, supported: bool,
                    ceiling: float | None = None, reason: str = "",
                    spread: tuple[float, float] | None = None) -> str:
    """`claims.verdict` on a claimed speed-up (10% grace above a range's high end), followed by the measurement,
    the matmul ceiling measured in the same run, and what that ceiling says about a shortfall.

    supported=False: the claim's setting is not this machine's (no unit for the format, or a CPU measured against
    a GPU claim): 'not comparable here' with `reason`, and no speed-up is claimed. spread: the interval the
    repeats allow (e.g. `claims.median_interval` of per-step ratios); it straddles an edge: 'inconclusive'.
    """
    grace = 0.1 * claimed_high if claimed_high is not None else 0.0
    text = claims.verdict(measured, claimed_low, claimed_high, slack=(0.0, grace), unit="x", applicable=supported,
                          reason=reason or "no hardware for this format", spread=spread)
    noise = f" (noise allows {min(spread):.2f}-{max(spread):.2f}x)" if spread is not None else ""
    text += f"; measured {measured:.2f}x{noise}" + ("" if supported else ", no speed-up claimed")
    if ceiling is not None:
        text += f"; the matmul ceiling measured in the same run is {ceiling:.2f}x"
        if supported and text.startswith("below"):
            text += (" (the hardware's own matmul gain is below the claim)" if ceiling < claimed_low else
                     " (the matmuls could gain more: this step is not matmul-bound at this size)")
    return text


# ---- The step-time benchmark: runs in a worker, wraps the notebook's plain training step from outside. ----

def precision_device() -> torch.device:
    """The device a one-rank benchmark runs on: this rank's GPU where there is one, else the CPU."""
    import os

    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


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
    low, high = claims.median_interval(ratios)
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


def fp32_settings() -> dict[str, str]:
    """The TF32 settings in force now, as 'home.name' -> value: only the names `fp32_matmul_precision` sets, so
    reading them never mixes the legacy and the new API (which raises once a new one is set)."""
    backends = torch.backends
    labels = [(backends.cuda.matmul, "cuda.matmul"), (getattr(backends.cudnn, "conv", None), "cudnn.conv"),
              (backends.cudnn, "cudnn"), (getattr(backends.mkldnn, "matmul", None), "mkldnn.matmul")]
    return {f"{next((label for obj, label in labels if obj is home), type(home).__name__)}.{name}":
            str(getattr(home, name)) for home, name in _tf32_settings()}


def empty_cache_cost(step, device: torch.device, pairs: int, empty=None) -> dict[str, list[float]]:
    """Seed 001's "clear the GPU memory periodically", priced: `pairs` pairs of one training step as usual and
    one that starts with `torch.cuda.empty_cache()`, both timed (`step_seconds`), the first pair left out.

    Why pairs of the same model's steps, and the emptying at the start of a step: `empty_cache()` costs nothing
    itself; the price is paid by whichever step next allocates, which must `cudaMalloc` every block again. Emptied
    at the end of a step inside an interleaved benchmark, it would bill the next mode (the fp32 baseline) and
    inflate every speed-up. Here the emptied step pays its own re-allocation, and the plain step after it finds
    the cache refilled with blocks of exactly its sizes. `empty`: the call that empties (a test passes its own).
    """
    empty = empty or torch.cuda.empty_cache
    out = {"plain_s": [], "emptied_s": []}

    def emptied():
        empty()
        return step()

    for _ in range(pairs):
        out["plain_s"].append(step_seconds(step, device)[1])
        out["emptied_s"].append(step_seconds(emptied, device)[1])
    return {k: v[1:] for k, v in out.items()}


def time_precisions(train_step, make_model, get_batch, modes: dict[str, dict], steps: int, warmup: int,
                    mlp_shape: tuple[int, int, int], ceiling_n: int = 512, empty_cache_of: str | None = None,
                    lr: float = 1e-3, seed: int = 0, device: torch.device | None = None) -> dict:
    """Train one model per mode from the same weights on the same batches, steps interleaved, and time each step.

    Runs in a worker. The notebook's plain pieces do the training: `make_model()` (on the CPU), `get_batch(g)`
    -> (x, y) from a torch.Generator, `train_step(model, opt, scaler, x, y, dtype)` -> loss. Each mode is a
    dict: `dtype` (the autocast dtype, float32 for none), `fp32_precision` ('ieee' or 'tf32', set here in the
    worker around each of the mode's steps, and restored after), optional `compile` (torch.compile the model).
    fp16 gets a GradScaler. Interleaving (one step of every mode in turn) makes a noisy neighbour slow every mode
    alike, so a per-step ratio against the first mode is a ratio taken side by side. The first `warmup` steps of
    every mode (compilation, autotuning, the allocator's first blocks) are left out of `times` and `ratios`.
    The matmul throughput per format is measured in the same process: the ceiling a step's speed-up is bounded
    by, at the model's MLP shape `mlp_shape` (tokens, d, 4d) and at a large square (`ceiling_n`).
    `lr`: AdamW's learning rate. `empty_cache_of`: on a GPU, the mode whose model then prices
    `torch.cuda.empty_cache()` (`empty_cache_cost`). `device`: where to run (default `precision_device()`: the
    rank's GPU where there is one); a caller whose pieces are written for one device (a test's CPU autocast) names it.
    """
    import warnings

    device = device or precision_device()
    runs = {}
    for name, mode in modes.items():
        torch.manual_seed(seed)  # the same initial weights in every mode
        model = make_model().to(device)
        parameters = sum(p.numel() for p in model.parameters())
        if mode.get("compile"):
            model = torch.compile(model)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=device.type == "cuda")
        scaler = torch.amp.GradScaler(device.type, enabled=mode["dtype"] == torch.float16)
        runs[name] = {"model": model, "opt": opt, "scaler": scaler, "losses": [], "times": [], "settings": None}

    def step_of(name, x, y):
        r = runs[name]
        return lambda: train_step(r["model"], r["opt"], r["scaler"], x, y, modes[name]["dtype"])

    g = torch.Generator().manual_seed(seed)
    with warnings.catch_warnings():
        # Inductor advises TF32 when it compiles an fp32 model with TF32 off: here that is the point of the run.
        warnings.filterwarnings("ignore", message=".*TensorFloat32 tensor cores.*")
        for _ in range(steps):
            x, y = (t.to(device) for t in get_batch(g))
            for name, r in runs.items():
                with fp32_matmul_precision(modes[name]["fp32_precision"]):
                    r["settings"] = r["settings"] or fp32_settings()
                    loss, seconds = step_seconds(step_of(name, x, y), device)
                r["times"].append(seconds)
                r["losses"].append(float(loss))
        empty_cache = None
        if empty_cache_of is not None and device.type == "cuda":
            x, y = (t.to(device) for t in get_batch(g))
            with fp32_matmul_precision(modes[empty_cache_of]["fp32_precision"]):
                empty_cache = {"mode": empty_cache_of,
                               **empty_cache_cost(step_of(empty_cache_of, x, y), device, steps - warmup + 1)}
    first = next(iter(modes))
    times = {n: r["times"][warmup:] for n, r in runs.items()}
    dtype_of = {n: (m["dtype"], m["fp32_precision"]) for n, m in modes.items() if not m.get("compile")}
    return {
        "device": str(device), "hardware": hardware_formats(device), "parameters": parameters,
        "losses": {n: r["losses"] for n, r in runs.items()}, "times": times,
        "first_step_s": {n: r["times"][0] for n, r in runs.items()},
        "ratios": {n: [a / b for a, b in zip(times[first], t)] for n, t in times.items()},
        "fp32_settings": {n: r["settings"] for n, r in runs.items()},
        "empty_cache": empty_cache,
        "flops_model": matmul_flops(device, dtype_of, *mlp_shape),
        "flops_square": matmul_flops(device, dtype_of, ceiling_n, ceiling_n, ceiling_n),
        "errors": {n: matmul_error(device, dt, n=256, precision=p) for n, (dt, p) in dtype_of.items()},
    }


def cudnn_benchmark_effect(shapes: list[int], repeats: int = 20, channels: int = 64, batch: int = 32,
                           device: torch.device | None = None) -> dict | None:
    """What `torch.backends.cudnn.benchmark = True` does to a small conv net's training step, on a GPU.

    With benchmark on, cuDNN times several algorithms the first time it meets an input shape and keeps the
    fastest: the first step at a new shape pays that search, later steps at that shape may be faster. So it
    helps a fixed input shape and harms when shapes keep changing (variable image sizes or sequence lengths),
    where every new shape pays the search again. Returns None on a CPU (cuDNN is a CUDA library: the flag does
    nothing there). For each setting: the first step at each shape, and the median of `repeats` steps at the
    first shape. `device`: default `precision_device()`.
    """
    device = device or precision_device()
    if device.type != "cuda":
        return None
    out = {}
    old = torch.backends.cudnn.benchmark
    try:
        for bench in (False, True):
            torch.backends.cudnn.benchmark = bench
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Conv2d(3, channels, 3, padding=1), torch.nn.ReLU(),
                                      torch.nn.Conv2d(channels, channels, 3, padding=1), torch.nn.ReLU(),
                                      torch.nn.Conv2d(channels, 3, 3, padding=1)).to(device)

            def step(x):
                net(x).square().mean().backward()

            first = []
            for size in shapes:  # a new shape each time: the search, if any, is paid here
                x = torch.randn(batch, 3, size, size, device=device)
                first.append(step_seconds(lambda: step(x), device)[1])
            x = torch.randn(batch, 3, shapes[0], shapes[0], device=device)
            steady = [step_seconds(lambda: step(x), device)[1] for _ in range(repeats)]
            out[bench] = {"first_s": first, "steady_s": steady, "steady_median_s": statistics.median(steady)}
    finally:
        torch.backends.cudnn.benchmark = old
    return out


def bench_summary(bench: dict, modes: list[str]) -> tuple[dict, dict, dict]:
    """From `time_precisions`'s result: (speed-up, ceiling, final loss) per mode. The speed-up over the first
    mode is `ratio_with_noise` of the per-step ratios; the matmul ceiling is its base format's (a mode
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


def print_cudnn_effect(cudnn: dict) -> None:
    """`cudnn_benchmark_effect`'s result as three lines: first steps per new shape and the steady step, per
    setting, then the steady gain and the cost of the searches."""
    for bench_on in (False, True):
        r = cudnn[bench_on]
        print(f"cudnn.benchmark={bench_on!s:<5}: first step at each new shape "
              f"{[round(t * 1e3, 1) for t in r['first_s']]} ms; steady step {r['steady_median_s'] * 1e3:.2f} ms")
    gain = cudnn[False]["steady_median_s"] / cudnn[True]["steady_median_s"]
    print(f"fixed shape: benchmark=True runs {gain:.2f}x as fast once tuned; new shapes cost "
          f"{sum(cudnn[True]['first_s']) / sum(cudnn[False]['first_s']):.2f}x the time of untuned first steps")


# ---- Probes whose results notebook 05 shows as tables: what autocast produced, GradScaler at work. ----

LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtypes(device_type: str, dtype: torch.dtype) -> dict[str, str]:
    """Which dtype each kind of op produces under autocast on `device_type`; parameters and gradients stay fp32.

    The op lists differ by device and by torch version, so the table is measured, not copied from the docs.
    Call it for 'cuda' only in a worker (the kernel never touches CUDA).
    """
    from torch import nn

    torch.manual_seed(0)
    linear, norm = nn.Linear(64, 64).to(device_type), nn.LayerNorm(64).to(device_type)
    x, target = torch.randn(8, 64, device=device_type), torch.randint(0, 64, (8,), device=device_type)
    with torch.autocast(device_type, dtype=dtype):
        h = linear(x)
        seen = {"linear (matmul)": h.dtype, "layer_norm": norm(h).dtype, "softmax": torch.softmax(h, -1).dtype,
                "gelu": nn.functional.gelu(h).dtype, "add (h + x)": (h + x).dtype,
                "cross_entropy(h)": nn.functional.cross_entropy(h, target).dtype}
        loss = nn.functional.cross_entropy(h.float(), target)
    loss.backward()
    seen["parameter"], seen["gradient"] = linear.weight.dtype, linear.weight.grad.dtype
    return {k: str(v).replace("torch.", "") for k, v in seen.items()}


def autocast_tables(device_type: str = "cpu") -> dict[str, dict[str, str]]:
    """`autocast_dtypes` for bf16 and fp16 on `device_type`, keyed 'cpu bf16', 'cpu fp16', ..."""
    return {f"{device_type} {name}": autocast_dtypes(device_type, dtype) for name, dtype in LOW_PRECISION.items()}


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


def grad_scaler_at_work(make_model, get_batch, loss_of, steps: int, init_scale: float, growth_interval: int,
                        device: torch.device | None = None) -> tuple:
    """GradScaler observed from outside, in a worker (CUDA where there is a GPU): two records.

    (a) One linear layer under fp16 autocast with a tiny loss (2^-30): its weight gradient in fp32, in fp16 with
    no scaler (it underflows), and with a GradScaler (scaled, then unscaled). (b) `make_model()` trained under
    fp16 with a scale that starts at `init_scale`: per step the scale used, whether a gradient overflowed, whether
    the weights changed, the loss. `loss_of(model, x, y, dtype)` and `get_batch(g)` are the notebook's own.
    `device`: default `precision_device()`; `loss_of` must autocast on that device's type.
    """
    from torch import nn

    device = device or precision_device()
    torch.manual_seed(0)
    layer, x = nn.Linear(64, 64).to(device), torch.randn(16, 64, device=device)
    grads = {}
    for how in ("fp32", "fp16, no scaler", "fp16, GradScaler"):
        layer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.float16, enabled=how != "fp32"):
            loss = layer(x).float().sum() * 2.0 ** -30
        if how == "fp16, GradScaler":
            scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 16)
            scaler.scale(loss).backward()
            scaler.unscale_(torch.optim.SGD(layer.parameters(), lr=0.0))  # divides the gradients by the scale
        else:
            loss.backward()
        grads[how] = layer.weight.grad.cpu()
    torch.manual_seed(0)
    model = make_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device.type, init_scale=init_scale, growth_interval=growth_interval)
    g, log = torch.Generator().manual_seed(0), []
    for step in range(steps):
        x, y = (t.to(device) for t in get_batch(g))
        loss = loss_of(model, x, y, torch.float16)
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)  # true size now (fp32): inspect or clip here
        overflow = not all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        updated = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        log.append({"step": step, "scale": scale, "overflow": overflow, "updated": updated, "loss": loss.item()})
    return grads, log


def scaler_table(grads: dict, log: list[dict], rows: int = 10) -> str:
    """`grad_scaler_at_work`'s two records as text: per way of computing it, the share of the weight gradient that
    is zero and its largest magnitude; then the first `rows` steps of the GradScaler log (scale as a power of 2)."""
    import math

    lines = [f"{how:<17} weight gradient: {float((g == 0).float().mean()):6.1%} zeros, largest |g| {g.abs().max():.3g}"
             for how, g in grads.items()]
    lines += [f"step {r['step']:>2}  scale 2^{round(math.log2(r['scale'])):<3} overflow {r['overflow']!s:<5} "
              f"weights updated {r['updated']!s:<5} loss {r['loss']:.3f}" for r in log[:rows]]
    return "\n".join(lines)


def amp_and_sharding(init_distributed, make_model, get_batch, loss_of, allreduce_in, shard, policies: dict, steps: int,
                     record=contextlib.nullcontext, peak=contextlib.nullcontext, lr: float = 1e-3) -> dict:
    """Runs in every rank: DDP with bf16 autocast, its gradients all-reduced by the notebook's hook in fp32 then
    in bf16; then FSDP2 under each of `policies` ({name: (MixedPrecisionPolicy, checkpoint blocks?)}). Every
    variant starts from the same weights (seed 0) and sees the same batches (each rank its own).

    The notebook's plain pieces do the work: `init_distributed()` (the recipe's process group; returns the device),
    `make_model()` (a GPT with `.blocks` and `.head`), `get_batch(g)`,
    `loss_of(model, x, y, dtype)`, `allreduce_in(wire)` -> a DDP comm hook whose state is a list it appends
    (dtype, bytes) to, and `shard(model, mesh, policy, checkpoint)`. The last step of each variant runs inside
    `record()` (a collective log with `.summary()`) and, for FSDP2, `peak()` (with `.peak` bytes). Returns per
    variant: losses, the loss's dtype, the collectives ('hook' for DDP), the peak; for FSDP2 also the dtype the
    first block computes in and the dtype the weights are kept in. A rank uses its GPU where every local rank has
    one (NCCL), else the CPU with gloo. `lr`: AdamW's learning rate.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = init_distributed()
    try:
        return _amp_variants(make_model, get_batch, loss_of, allreduce_in, shard, policies, steps, record, peak,
                             device, init_device_mesh(device.type, (dist.get_world_size(),)), DDP, lr)
    finally:
        import gc

        gc.collect()  # models, optimizers and their pending work are freed before the group goes
        dist.destroy_process_group()


def wire_rows(variants: dict) -> list[tuple[str, str, int]]:
    """One rank's `amp_and_sharding` result as (variant: collective, dtypes, bytes per step) rows: the DDP hook's
    all-reduce, FSDP2's all-gather and reduce-scatter; what `wire_table` prints and `plots.precision.collective_bytes`
    draws."""
    from helpers.measure.comm_log import ALL_GATHER, REDUCE_SCATTER

    return [(f"{name}: {kind}", "/".join(c["dtypes"]).replace("torch.", ""), c["bytes"])
            for name, r in variants.items() for kind, c in (r.get("hook") or r["comm"]).items()
            if kind in ("all-reduce", ALL_GATHER, REDUCE_SCATTER)]


def wire_table(rows: list[tuple[str, str, int]]) -> str:
    """`wire_rows` as one line each: MiB per step and rank, and the dtype on the wire."""
    return "\n".join(f"{label:<46} {nbytes / 2**20:7.3f} MiB per step and rank, {dtype}"
                     for label, dtype, nbytes in rows)


def _amp_variants(make_model, get_batch, loss_of, allreduce_in, shard, policies, steps, record, peak, device,
                  mesh, DDP, lr) -> dict:
    """The variants of `amp_and_sharding`, inside a function so that every model is freed when it returns."""
    import torch.distributed as dist

    out = {}

    def run(name, model, dtype=torch.float32, log_peak=False):
        opt, g = torch.optim.AdamW(model.parameters(), lr=lr), torch.Generator().manual_seed(dist.get_rank())
        losses, comm, live = [], None, None
        for step in range(steps):
            x, y = (t.to(device) for t in get_batch(g))
            last = step == steps - 1
            with (record() if last else contextlib.nullcontext()) as comm, \
                    (peak() if last and log_peak else contextlib.nullcontext()) as live:
                loss = loss_of(model, x, y, dtype)
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        out[name] = {"losses": losses, "comm": comm.summary() if comm else None,
                     "peak": live.peak if live else None, "loss_dtype": str(loss.dtype)}
        return out[name]

    for wire in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = DDP(make_model().to(device), device_ids=[device.index] if device.type == "cuda" else None)
        sent = []
        model.register_comm_hook(sent, allreduce_in(wire))
        r = run(f"DDP, {str(wire)[6:]} all-reduce", model, torch.bfloat16)
        r["hook"] = {"all-reduce": {"bytes": sum(b for _, b in sent) // steps, "dtypes": sorted({d for d, _ in sent})}}
    for name, (policy, checkpoint) in policies.items():
        torch.manual_seed(0)
        model = shard(make_model().to(device), mesh, policy, checkpoint)
        seen = {}
        model.blocks[0].register_forward_pre_hook(lambda mod, args: seen.update(compute=str(args[0].dtype)))
        r = run(name, model, log_peak=True)
        r["compute"], r["weights"] = seen["compute"], str(model.head.weight.to_local().dtype)
    return out


# ---- Printing notebook 05's verdicts and headlines: one call per table, so the notebook keeps the claims and asserts
# ---- in view and this module keeps the loops that format them.

def warnings_of(fn, category: type[Warning] = Warning) -> list[str]:
    """The messages of the warnings of `category` that calling `fn()` emits, each shown even if shown before (the
    'always' filter): how notebook 05 lets torch itself say that a spelling is deprecated or an argument missing."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if issubclass(w.category, category)]


def print_speed_claims(speed_claims: dict, speedup: dict, ceiling: dict, where: str) -> None:
    """One `speedup_verdict` line per claim, {label: (mode, low, high, comparable here, the claim's setting)},
    with the mode's measured median, its interval and its matmul ceiling; `where` describes this machine."""
    for label, (m, low, high, comparable, setting) in speed_claims.items():
        s = speedup[m]
        print(f"{label:<30}" + speedup_verdict(s["median"], low, high, comparable, ceiling[m],
                                               reason=f"{setting}; {where}", spread=(s["low"], s["high"])))


def print_h100_targets(speedup: dict, targets: dict[str, float], gpu_name: str) -> None:
    """The project's speed-up targets for an H100 ({mode: target x over eager fp32}) as verdicts with their noise,
    never asserted; a mode left out of the run (no `COMPILE`) says so, another GPU is 'not comparable here'."""
    for m, target in targets.items():
        s = speedup.get(m)
        print(f"{m} over eager fp32 (TF32 off), target {target}x on an H100: " + ("not measured (COMPILE=False)" if s
              is None else claims.verdict(s["median"], target, None, unit="x", spread=(s["low"], s["high"]),
                                          applicable=("H100" in gpu_name),
                                          reason=f"the target is for an H100; this GPU: {gpu_name}")))


def headline_speedups(speedup: dict, flops_square: dict, ceiling_n: int) -> None:
    """Headline figures of a `time_precisions` run: every mode's speed-up over the first (the fp32 baseline), and
    the matmul throughput per format (the ceilings, for docs/measurements.md beside the speed-ups)."""
    from helpers.measure.headline import headline

    for m in list(speedup)[1:]:
        headline(f"{m} step speed-up over fp32", speedup[m]["median"], "x")
    for m, flops in flops_square.items():
        headline(f"{m} matmul throughput, {ceiling_n}³", flops / 1e12, "TFLOP/s")


def print_empty_cache_cost(ec: dict) -> None:
    """`time_precisions`'s `empty_cache` record (GPU only: pairs of steps, the second opening with
    `torch.cuda.empty_cache()`) as the verdict on 'empty the cache periodically': a ratio above 1 harms."""
    cost = ratio_with_noise([a / b for a, b in zip(ec["emptied_s"], ec["plain_s"])])
    print(f"empty_cache before every step ({ec['mode']}, {len(ec['plain_s'])} pairs): step time {cost['median']:.2f}x "
          f"of the plain step's -> 'harms': "
          + claims.verdict(cost["median"], 1.0, None, spread=(cost["low"], cost["high"]), unit="x")
          + f" (noise allows {cost['low']:.2f}-{cost['high']:.2f}x)")


def wire_halving(variants: dict, n_params: int) -> str:
    """Seed 001's 'communication falls by 50%' judged on one rank's `amp_and_sharding` bytes, one line per way of
    mixing precision: the bytes relative to fp32 (DDP: `4 * n_params` per all-reduce; FSDP2: the fp32 policy's
    collective) and whether that halves them. Bytes are counted, not timed: no noise enters."""
    from helpers.measure.comm_log import ALL_GATHER, REDUCE_SCATTER

    ddp = {w: variants[f"DDP, {w} all-reduce"]["hook"]["all-reduce"]["bytes"] for w in ("float32", "bfloat16")}
    f32, f16 = variants["FSDP2 fp32"]["comm"], variants["FSDP2 bf16 params, fp32 reduce"]["comm"]
    gathered, scattered = (f16[k]["bytes"] / f32[k]["bytes"] for k in (ALL_GATHER, REDUCE_SCATTER))
    return "\n".join(f"  {label:<40} {ratio:.2f}x -> "
                     + ("halved: holds" if ratio <= 0.5 else "not reduced: does not hold")
                     for label, ratio in (("DDP + autocast (default all-reduce)", ddp["float32"] / (4 * n_params)),
                                          ("DDP + autocast + bf16 comm hook", ddp["bfloat16"] / (4 * n_params)),
                                          ("FSDP2 policy, all-gather", gathered),
                                          ("FSDP2 policy, reduce-scatter (fp32)", scattered)))
