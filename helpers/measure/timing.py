"""Timing a step honestly, and summarising the times: one implementation for every notebook.

Why a module: a wall-clock time means something only when the device is idle at both ends (else it times a
kernel launch), when every rank starts together (else one rank's late arrival is charged to another's
communication), and when it is summarised by a median and quartiles, which a noisy neighbour on a shared machine
barely moves. `collectives`, `ceilings`, `tensor_parallel`, the training plots and the notebooks all use these.
torch is imported lazily: `summarize` is pure arithmetic the kernel may call.
"""
from __future__ import annotations

import statistics
import time

from helpers.devices import synchronize


def timed(fn, device=None, barrier: bool = True):
    """(what `fn()` returned, its wall seconds): `device` idle before and after, ranks together when asked.

    barrier: wait at a `dist.barrier()` first when a process group exists, so every rank starts the clock together.
    """
    import torch.distributed as dist

    synchronize(device)
    if barrier and dist.is_available() and dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - start


def time_steps(step, repeats: int, warmup: int = 2, device=None, barrier: bool = True) -> list[float]:
    """Wall seconds of `repeats` calls of `step()` after `warmup` untimed ones, each call `timed`."""
    for _ in range(warmup):
        step()
    return [timed(step, device, barrier)[1] for _ in range(repeats)]


def summarize(values) -> dict:
    """Median, quartiles (inclusive method), half the inter-quartile range, min and max of timings (seconds)."""
    ordered = sorted(float(v) for v in values)
    if not ordered:
        raise ValueError("no values to summarise")
    if len(ordered) >= 2:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    return {"median_s": statistics.median(ordered), "q1_s": q1, "q3_s": q3, "half_iqr_s": (q3 - q1) / 2,
            "min_s": ordered[0], "max_s": ordered[-1]}
