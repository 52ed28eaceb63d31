"""Watching DDP from the inside: how many buckets it builds, what it hands to the wire (timing: helpers.measure.timing).

Why a module of its own: notebook 02 must show the DDP lines themselves (the wrapper, `no_sync`, the comm hook,
`Join`), not the book-keeping around them. Everything here observes or predicts; nothing changes what DDP
computes. The predictions are the closed forms the notebook asserts against:

- `bucket_plan`: DDP's greedy bucket assignment (after its first iteration it rebuilds buckets in the order
  gradients became ready, which for a feed-forward model is the reverse of `model.parameters()`).
- `hook_payload_bytes`: what a comm hook all-reduces per step: 4 bytes a value for fp32, 2 for fp16/bf16, and for
  PowerSGD an n x m matrix at rank r sends (n + m) * r values instead of n * m.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

MIB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25  # DDP's default bucket_cap_mb


# ----------------------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def accuracy(model: torch.nn.Module, split, device: torch.device | str | None = None, batch_size: int = 1024) -> float:
    """Fraction of `split` (a helpers.data.Split) that `model` classifies correctly; the model's mode is restored."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct = 0
    for start in range(0, len(split), batch_size):
        x = split.x[start:start + batch_size].to(device)
        y = split.y[start:start + batch_size].to(device)
        correct += int((model(x).argmax(dim=1) == y).sum())
    model.train(was_training)
    return correct / len(split)


# ----------------------------------------------------------------------------------------------- buckets


def greedy_buckets(sizes: list[int], limits: list[int]) -> list[list[int]]:
    """DDP's assignment of tensors (sizes in bytes, in the order given) to buckets.

    A tensor joins the open bucket; the bucket closes as soon as it holds at least its limit (so a bucket may
    exceed it by one tensor). Bucket i uses limits[i]; the last limit repeats. A leftover open bucket is kept.
    """
    if not limits or any(limit <= 0 for limit in limits):
        raise ValueError(f"bucket limits must be positive, got {limits}")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index, size in enumerate(sizes):
        current.append(index)
        filled += size
        if filled >= limits[min(len(buckets), len(limits) - 1)]:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


def bucket_limits(bucket_cap_mb: float | None) -> list[int]:
    """The byte limits DDP uses when it rebuilds its buckets: a small first bucket only for the default cap."""
    if bucket_cap_mb is None:
        return [dist._DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_BUCKET_CAP_MB * MIB]
    return [int(bucket_cap_mb * MIB)]


def bucket_plan(model: torch.nn.Module, bucket_cap_mb: float | None = None) -> list[int]:
    """Bytes of each bucket DDP reduces per step from the second iteration on (fp32 gradients, one device).

    The first iteration uses a single bucket (DDP does not know the order in which gradients become ready yet);
    it then rebuilds buckets in ready order, which for a model whose forward uses its parameters in
    registration order is `reversed(model.parameters())`.
    """
    sizes = [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad][::-1]
    return [sum(sizes[i] for i in bucket) for bucket in greedy_buckets(sizes, bucket_limits(bucket_cap_mb))]


# ----------------------------------------------------------------------------------------------- counting


def _counted_hook(counter: "CommCounter", bucket):
    buffer = bucket.buffer()
    with counter.lock:
        counter.calls.append((bucket.index(), buffer.numel(), buffer.numel() * buffer.element_size()))
    return counter.hook(counter.state, bucket)


@dataclass
class CommCounter:
    """A comm-hook state that records every bucket DDP hands over, then lets `hook` (plain all-reduce by default,
    which is what DDP does without a hook) do the communication.

    Register with `counter.register(ddp_model)`. `calls` holds one (bucket index, elements, bytes) per bucket.
    """

    hook: object = None
    state: object = None
    calls: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self):
        if self.hook is None:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            self.hook = allreduce_hook

    def register(self, ddp_model) -> "CommCounter":
        ddp_model.register_comm_hook(self, _counted_hook)
        return self

    def reset(self) -> None:
        with self.lock:
            self.calls.clear()

    @property
    def count(self) -> int:
        return len(self.calls)

    @property
    def bucket_bytes(self) -> list[int]:
        return [b for _, _, b in self.calls]


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
