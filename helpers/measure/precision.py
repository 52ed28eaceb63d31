"""Measuring mixed precision honestly: what the hardware offers, the matmul ceiling, GradScaler's arithmetic.

Why a module: a speed-up claimed for AMP or TF32 means nothing without the hardware it ran on and without the
ceiling the same hardware sets. A step can gain at most what its matmuls gain (plus up to 2x on memory-bound ops
that move half the bytes), so the notebook measures the matmul throughput per precision in the same run as the
training step and compares the two. Everything here runs in a worker (it may touch CUDA) or on the CPU.
"""
from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def fp32_matmul_precision(precision: str):
    """Run fp32 matmuls as 'ieee' (true fp32) or 'tf32', through the per-backend settings of PyTorch >= 2.9.

    `torch.backends.cuda.matmul.fp32_precision` (cuBLAS) and `torch.backends.cudnn.conv.fp32_precision` replaced
    `allow_tf32` and `torch.set_float32_matmul_precision('high')`; the oneDNN (CPU) setting is set alike so a CPU
    run is asked for the same thing. The previous values are restored on exit.
    """
    if precision not in ("ieee", "tf32"):
        raise ValueError(f"precision must be 'ieee' or 'tf32', not {precision!r}")
    settings = [torch.backends.cuda.matmul, torch.backends.cudnn.conv]
    mkldnn_matmul = getattr(torch.backends.mkldnn, "matmul", None)
    if mkldnn_matmul is not None:
        settings.append(mkldnn_matmul)
    old = [s.fp32_precision for s in settings]
    try:
        for s in settings:
            s.fp32_precision = precision
        yield
    finally:
        for s, value in zip(settings, old):
            s.fp32_precision = value


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
                    ceiling: float | None = None, reason: str = "") -> str:
    """`claims.verdict` on a claimed speed-up (10% grace above a range's high end), followed by the measurement,
    the matmul ceiling measured in the same run, and what that ceiling says about a shortfall.

    supported=False: the hardware lacks the format, the claim cannot apply here and no speed-up is claimed.
    """
    grace = 0.1 * claimed_high if claimed_high is not None else 0.0
    text = claims.verdict(measured, claimed_low, claimed_high, slack=(0.0, grace), unit="x", applicable=supported,
                          reason=reason or "no hardware for this format")
    text += f"; measured {measured:.2f}x" + ("" if supported else ", no speed-up claimed")
    if ceiling is not None:
        text += f"; the matmul ceiling measured in the same run is {ceiling:.2f}x"
        if supported and text.startswith("below"):
            text += (" (the hardware's own matmul gain is below the claim)" if ceiling < claimed_low else
                     " (the matmuls could gain more: this step is not matmul-bound at this size)")
    return text
