"""Watching DDP from the inside: what it hands to the wire, and the variants and sizes its notebooks time (the timing
workers are scripts/ddp_bench.py's `step_times` and `traced_step`).

Why a module of its own: notebooks 02 and 02b must show the DDP lines themselves (the wrapper, `no_sync`, the comm hook,
`Join`), not the book-keeping around them. Everything here observes or predicts; nothing changes what DDP
computes. DDP's bucket rule is notebook 02's lesson and lives in its cells (scripts/ddp_bench.py's `bucket_plan`);
the prediction here is the closed form notebook 02b asserts against:

- `hook_payload_bytes`: what a comm hook all-reduces per step: 4 bytes a value for fp32, 2 for fp16/bf16, and for
  PowerSGD an n x m matrix at rank r sends (n + m) * r values instead of n * m.
"""
from __future__ import annotations

import math
import threading
from typing import NamedTuple

import torch.distributed as dist

from helpers.devices import cpu_ranks_env

# ----------------------------------------------------------------------------------------------- counting


class PayloadCounter:
    """Counts the tensors handed to `torch.distributed.all_reduce` inside the `with` block, in this process.

    Comm hooks (allreduce_hook, fp16/bf16_compress_hook, PowerSGD) call `dist.all_reduce` from Python, also from
    future callbacks on other threads, so this sees exactly what they put on the wire: the all-reduce payload
    (a ring all-reduce then moves 2(N-1)/N times that per rank). DDP's built-in C++ all-reduce (no hook
    registered) does not pass through Python and is not seen: register `allreduce_hook` to count it.
    """

    def __init__(self):
        self.calls: list[tuple[int, int]] = []  # (elements, bytes per element)
        self._lock = threading.Lock()
        self._original = None

    def __enter__(self) -> "PayloadCounter":
        self._original = dist.all_reduce
        original = self._original

        def counting_all_reduce(tensor, *args, **kwargs):
            with self._lock:
                self.calls.append((tensor.numel(), tensor.element_size()))
            return original(tensor, *args, **kwargs)

        dist.all_reduce = counting_all_reduce
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self._original

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()

    @property
    def bytes(self) -> int:
        return sum(n * size for n, size in self.calls)

    @property
    def values(self) -> int:
        return sum(n for n, _ in self.calls)


# ----------------------------------------------------------------------------------------------- compression


def powersgd_values(shape: tuple[int, ...], rank: int, min_compression_rate: float = 2.0) -> int:
    """Values PowerSGD all-reduces for one gradient of `shape`: (n + m) * r if worth compressing, else n * m.

    PowerSGD views the gradient as an n x m matrix (n = shape[0]); a rank-r approximation P (n x r) Q^T (r x m)
    sends P and Q. It compresses only when (n + m) * r * min_compression_rate < n * m (so biases never are).
    """
    n = shape[0] if len(shape) else 1
    m = math.prod(shape[1:]) if len(shape) > 1 else 1
    r = min(n, m, rank)
    compressed = (n + m) * r
    return compressed if compressed * min_compression_rate < n * m else n * m


def hook_payload_bytes(shapes: list[tuple[int, ...]], method: str, rank: int | None = None,
                       min_compression_rate: float = 2.0) -> int:
    """Bytes a comm hook all-reduces per step for fp32 gradients of `shapes` (the closed form).

    method: 'allreduce' (4 bytes a value), 'fp16' or 'bf16' (2 bytes a value), 'powersgd' (needs `rank`).
    """
    numels = [math.prod(s) for s in shapes]
    if method == "allreduce":
        return 4 * sum(numels)
    if method in ("fp16", "bf16"):
        return 2 * sum(numels)
    if method == "powersgd":
        if rank is None:
            raise ValueError("PowerSGD's payload depends on its matrix_approximation_rank: pass rank=")
        return 4 * sum(powersgd_values(tuple(s), rank, min_compression_rate) for s in shapes)
    raise ValueError(f"unknown method {method!r}: use 'allreduce', 'fp16', 'bf16' or 'powersgd'")


def expected_payload(shapes: list[tuple[int, ...]], method: str, rank: int | None, steps: int,
                     start_powersgd_iter: int = 0) -> dict:
    """What a run of `steps` steps with a comm hook should hand to dist.all_reduce, by the closed form:
    {"bytes_per_step": the hook's payload, "expected_total": all steps together}. PowerSGD all-reduces plain fp32
    gradients for its first `start_powersgd_iter` steps (its warm-up), then the compressed P and Q."""
    per_step = hook_payload_bytes(shapes, method, rank)
    plain_steps = min(start_powersgd_iter, steps) if method == "powersgd" else 0
    total = plain_steps * hook_payload_bytes(shapes, "allreduce") + (steps - plain_steps) * per_step
    return {"bytes_per_step": per_step, "expected_total": total}


# ----------------------------------------------------------------------------------------------- sizes

# The sizes notebooks 02 and 02b share, by SIZE: (HIDDEN, DEPTH) of the DigitsMLP trained to accuracy, (BIG_HIDDEN,
# BIG_DEPTH) of the one for buckets, ZeRO and scaling (at "gpu" size its gradients exceed DDP's 25 MB default
# bucket), EPOCHS of training, TIMED_STEPS behind every median time.
NOTEBOOK_SIZES = {"smoke": (256, 2, 512, 3, 4, 5), "cpu": (256, 2, 768, 3, 5, 8), "gpu": (1024, 3, 2048, 4, 10, 20)}
# DDP's own cost at world size 1 on a GPU (notebook 02b), by SIZE: (hidden, depth, batch) of the DigitsMLP timed with
# and without DDP. At "gpu" size 8192 x 4 holds over 200 M parameters and a step is 6 x parameters x batch, about
# 5 TFLOP: large enough on an H100 that compute, not the launching of small kernels, sets the step's time, as in a
# real job (the scaling sweep's model at batch 32 would not be). A CPU measures DDP's overhead on the scaling
# sweep's model instead (the world-size-1 launch of notebook 02b's weak scaling).
GPU_OVERHEAD_MODEL = {"smoke": (2048, 4, 512), "cpu": (2048, 4, 512), "gpu": (8192, 4, 4096)}


class DemoRanks(NamedTuple):
    """Where a DDP notebook's multi-rank demos run: `gpu_ranks` (a GPU per rank: NCCL), the workers' `env`
    (GPUs hidden from CPU ranks, see `helpers.devices.cpu_ranks_env`) and `where`, the sentence the verdicts print."""
    gpu_ranks: bool
    env: dict
    where: str


def demo_ranks(world_size: int, facts: dict, global_batch: int, size: str) -> DemoRanks:
    """Decide, print and check where notebooks 02 and 02b run their ranks (the same decision in both).

    Why it refuses fewer than 2 ranks or a batch they cannot split: every demo compares several ranks that share
    one global batch with one process that takes it whole."""
    if world_size < 2 or global_batch % world_size:
        raise ValueError(f"the DDP notebooks compare 2+ ranks that split GLOBAL_BATCH={global_batch} evenly; "
                         f"world size {world_size}")
    gpu_ranks = facts["gpus"] >= world_size
    where = f"{world_size} GPU ranks, NCCL" if gpu_ranks else f"{world_size} CPU ranks, gloo" + (
        f" (this machine has {facts['gpus']} GPU: the demos need more ranks than that)" if facts["gpus"] else "")
    print(f"\nworld size {world_size}, {size} sizes: {where}")
    if not gpu_ranks and world_size > facts["cores"]:
        print(f"WARNING: {world_size} CPU ranks on {facts['cores']} cores: every time below measures the scheduler "
              "as well")
    return DemoRanks(gpu_ranks, cpu_ranks_env(world_size, facts["gpus"]), where)


# ----------------------------------------------------------------------------------------------- timing DDP steps


def ratio_interval(numerator: list[float], denominator: list[float], **bootstrap) -> tuple[float, float]:
    """The interval of median(numerator) / median(denominator) that both medians' bootstrap intervals allow."""
    from helpers.measure.advice import median_interval

    n_lo, n_hi = median_interval(numerator, **bootstrap)
    d_lo, d_hi = median_interval(denominator, **bootstrap)
    return n_lo / d_hi, n_hi / d_lo


def percent_change(new_times: list[float], old_times: list[float]) -> tuple[float, tuple[float, float]]:
    """100 x (median(new) / median(old) - 1): how much longer (or, for rates, larger) `new` is, in percent, with
    the interval (in percent) that the two medians' bootstrap intervals allow. Pass 1/rate lists for speeds."""
    import statistics

    low, high = ratio_interval(new_times, old_times)
    return 100 * (statistics.median(new_times) / statistics.median(old_times) - 1), (100 * (low - 1), 100 * (high - 1))


def scaling_variants(bucket_bytes: list[int]) -> dict:
    """The variants notebook 02b's weak-scaling launches time with scripts/ddp_bench.py's `step_times` at each world
    size: the DDP step, the same step under no_sync (compute only) and the all-reduce of its buckets alone
    (`bucket_bytes`: the buckets DDP makes of the model, ddp_bench's `bucket_plan`). Parameters come back for the
    replicas' check only (the DDP step's)."""
    modes = {m: {"mode": m, "count_buckets": False, "params": m == "step"} for m in ("step", "no_sync", "allreduce")}
    modes["allreduce"]["bucket_bytes"] = list(bucket_bytes)
    return modes
