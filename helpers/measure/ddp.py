"""Watching DDP from the inside: how many buckets it builds, what it hands to the wire (timing: helpers.measure.timing).

Why a module of its own: notebooks 02 and 02b must show the DDP lines themselves (the wrapper, `no_sync`, the comm hook,
`Join`), not the book-keeping around them. Everything here observes or predicts; nothing changes what DDP
computes. The predictions are the closed forms the notebook asserts against:

- `bucket_plan`: DDP's greedy bucket assignment (after its first iteration it rebuilds buckets in the order
  gradients became ready, which for a feed-forward model is the reverse of `model.parameters()`).
- `hook_payload_bytes`: what a comm hook all-reduces per step: 4 bytes a value for fp32, 2 for fp16/bf16, and for
  PowerSGD an n x m matrix at rank r sends (n + m) * r values instead of n * m.
"""
from __future__ import annotations

import contextlib
import gc
import math
import threading
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

from helpers.devices import cpu_ranks_env

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


def expected_payload(shapes: list[tuple[int, ...]], method: str, rank: int | None, steps: int,
                     start_powersgd_iter: int = 0) -> dict:
    """What a run of `steps` steps with a comm hook should hand to dist.all_reduce, by the closed form:
    {"bytes_per_step": the hook's payload, "expected_total": all steps together}. PowerSGD all-reduces plain fp32
    gradients for its first `start_powersgd_iter` steps (its warm-up), then the compressed P and Q."""
    per_step = hook_payload_bytes(shapes, method, rank)
    plain_steps = min(start_powersgd_iter, steps) if method == "powersgd" else 0
    total = plain_steps * hook_payload_bytes(shapes, "allreduce") + (steps - plain_steps) * per_step
    return {"bytes_per_step": per_step, "expected_total": total}


# ----------------------------------------------------------------------------------------------- CPU ranks




# The sizes notebooks 02 and 02b share, by SIZE: (HIDDEN, DEPTH) of the DigitsMLP trained to accuracy, (BIG_HIDDEN,
# BIG_DEPTH) of the one for buckets, ZeRO and scaling (at "gpu" size its gradients exceed DDP's 25 MB default
# bucket), EPOCHS of training, TIMED_STEPS behind every median time.
NOTEBOOK_SIZES = {"smoke": (256, 2, 512, 3, 4, 5), "cpu": (256, 2, 768, 3, 5, 8), "gpu": (1024, 3, 2048, 4, 10, 20)}
# DDP's own cost at world size 1 on a GPU (notebook 02b), by SIZE: (hidden, depth, batch) of the DigitsMLP timed with
# and without DDP. At "gpu" size 8192 x 4 holds over 200 M parameters and a step is 6 x parameters x batch, about
# 5 TFLOP: large enough on an H100 that compute, not the launching of small kernels, sets the step's time, as in a
# real job (the scaling sweep's model at batch 32 would not be). A CPU measures DDP's overhead on the scaling
# sweep's model instead (weak_scaling's world-size-1 launch).
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
    from helpers.measure.claims import median_interval

    n_lo, n_hi = median_interval(numerator, **bootstrap)
    d_lo, d_hi = median_interval(denominator, **bootstrap)
    return n_lo / d_hi, n_hi / d_lo


def _event_time(step, device) -> float:
    """Seconds of one call of step(), after a barrier so that every rank starts together: CUDA events on a GPU
    (the GPU's own clock), else wall time with the device idle at both ends."""
    from helpers.measure.timing import timed

    if device.type != "cuda":
        return timed(step, device)[1]
    torch.cuda.synchronize(device)
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _digits_batch(batch_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `batch_size` training digits of this rank's share (rank r takes every world-th sample)."""
    from helpers.data import load_digits

    train = load_digits()[0]
    index = torch.arange(dist.get_rank(), dist.get_rank() + batch_size * dist.get_world_size(),
                         dist.get_world_size()) % len(train)
    return train.x[index].to(device), train.y[index].to(device)


def _variant_step(spec: dict, model_factory, x, y, device, seed: int):
    """(the module, a function running one step of the variant) for one `step_times` variant."""
    mode, ddp_kwargs, accum = spec.get("mode", "step"), spec.get("ddp", {}), spec.get("accum", 1)
    torch.manual_seed(seed)
    module = spec.get("factory", model_factory)().to(device)
    model = module if ddp_kwargs is None else torch.nn.parallel.DistributedDataParallel(
        module, device_ids=[device.index] if device.type == "cuda" else None, **ddp_kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    grads = [p for p in module.parameters() if p.requires_grad]
    flat = [torch.zeros(b // 4, device=device) for b in bucket_plan(module)] if mode == "allreduce" else []
    world = dist.get_world_size()

    def step():
        optimizer.zero_grad()
        if mode == "allreduce":
            for t in flat:
                dist.all_reduce(t)
            return
        for micro in range(accum):  # accum > 1: gradient accumulation, all-reduce on the last only
            skip = mode in ("no_sync", "delayed") or micro < accum - 1
            with model.no_sync() if skip else contextlib.nullcontext():
                torch.nn.functional.cross_entropy(model(x), y).backward()
        if mode == "delayed":
            buffer = torch.cat([p.grad.reshape(-1) for p in grads])
            dist.all_reduce(buffer)
            torch.nn.utils.vector_to_parameters(buffer / world, [p.grad for p in grads])
        optimizer.step()

    return module, step


def _step_peak_bytes(step, device) -> int:
    """Peak bytes that one step() holds beyond what was allocated before it. On a GPU the caching allocator's own
    statistics (they also see what DDP's C++ reducer allocates); elsewhere the dispatch-mode probe of notebook 05."""
    from helpers.measure.activations import LiveTensorBytes

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with LiveTensorBytes() as live:
        step()
    return live.peak


def _bucket_bytes(spec: dict, model_factory, x, y, device, seed: int) -> list[int]:
    """The bytes of each bucket a fresh DDP copy of the variant reduces in its second iteration (comm hook)."""
    torch.manual_seed(seed)
    counted = torch.nn.parallel.DistributedDataParallel(
        spec.get("factory", model_factory)().to(device), device_ids=[device.index] if device.type == "cuda" else None,
        **spec.get("ddp", {}))
    counter = CommCounter().register(counted)
    for _ in range(2):  # the first iteration uses one bucket; the second, the rebuilt ones
        counter.reset()
        torch.nn.functional.cross_entropy(counted(x), y).backward()
    return counter.bucket_bytes


def step_times(model_factory, batch_size: int, variants: dict, repeats: int, seed: int = 0, warmup: int = 2) -> dict:
    """A measurement worker (launch it; it joins the process group itself): times variants of one training step.

    Why here and not in the notebook: the notebook shows the DDP lines (the wrapper, `no_sync`, `bucket_cap_mb`);
    the timing loop, the bucket counting and the memory probe are book-keeping around them.

    model_factory(): the module (built after `torch.manual_seed(seed)`, so every variant starts from the same
    weights). variants[label] = {"ddp": DDP kwargs, or None for the plain module without DDP; "mode": "step"
    (forward, backward, SGD step), "no_sync" (the same step with DDP's all-reduce skipped: compute only),
    "delayed" (backward under no_sync, then one all-reduce of all gradients after it: Apex's
    delay_all_reduce=True), or "allreduce" (only the all-reduces of DDP's buckets, no compute);
    "accum": micro-batches per step (no_sync on all but the last); "factory": another model_factory;
    "memory": also record the peak tensor bytes of one step (CUDA memory statistics on a GPU);
    "count_buckets" (default True for DDP variants); "params" (default True: return the trained parameters; False
    spares sending a large model's copy back);
    "group": variants of one group (default: all in one) are built together and timed in turn, repeat after
    repeat, so that a load that comes and goes on a shared machine hits them alike (a ratio taken side by side);
    groups are timed one after the other, each freed before the next is built (many large models: less memory)}.
    Returns per label: "times" (seconds per repeat), "buckets" (bytes of each bucket DDP reduced in a step,
    counted by a comm hook, from its second iteration), "peak_bytes", "params" (after every step ran; every
    variant runs warmup + repeats steps, plus one with "memory").
    """
    from helpers.devices import default_backend, rank_device

    device = rank_device()
    backend = default_backend()
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any collective: CUDA events and NCCL on this rank's own GPU
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    try:
        x, y = _digits_batch(batch_size, device)
        out = {label: {"times": []} for label in variants}
        groups: dict = {}
        for label, spec in variants.items():
            groups.setdefault(spec.get("group"), []).append(label)
        for labels in groups.values():
            built = {label: _variant_step(variants[label], model_factory, x, y, device, seed) for label in labels}
            for _ in range(warmup):
                for _, step in built.values():
                    step()
            for _ in range(repeats):
                for label, (_, step) in built.items():
                    out[label]["times"].append(_event_time(step, device))
            for label, (module, step) in built.items():
                spec = variants[label]
                if spec.get("memory"):
                    out[label]["peak_bytes"] = _step_peak_bytes(step, device)
                if spec.get("params", True):
                    out[label]["params"] = torch.nn.utils.parameters_to_vector(module.parameters()).detach().cpu()
                if spec.get("ddp", {}) is not None and spec.get("count_buckets", True):
                    out[label]["buckets"] = _bucket_bytes(spec, model_factory, x, y, device, seed)
            del built
            gc.collect()
        return out
    finally:
        gc.collect()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------- data loading


def loader_throughput(settings: dict, batch_size: int, batches: int, repeats: int) -> dict:
    """A measurement worker (world size 1): samples per second each DataLoader setting delivers to this rank's
    device, on the notebook's data (the digits as a TensorDataset), per repeat.

    settings[label] = DataLoader keyword arguments (num_workers, pin_memory, prefetch_factor,
    persistent_workers...). Each repeat iterates `batches` batches from a fresh iterator; with workers, their
    start-up is part of a repeat only once (persistent workers), as in a training job's epochs. On a GPU each
    batch is copied to it (non_blocking, which only overlaps when the memory is pinned).
    """
    import time

    from torch.utils.data import DataLoader

    from helpers.data import digits_dataset, load_digits
    from helpers.devices import rank_device

    device = rank_device()
    dataset = digits_dataset(load_digits()[0])
    out = {}
    for label, kwargs in settings.items():
        loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, **kwargs)
        rates = []
        for _ in range(repeats + 1):  # the first pass starts the workers: not timed
            start, seen = time.perf_counter(), 0
            for (x, y), _ in zip(loader, range(batches)):
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                seen += len(y)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            rates.append(seen / (time.perf_counter() - start))
        out[label] = rates[1:]
        del loader
        gc.collect()
    return out


def payload_counted(body, device, *args, **kwargs) -> dict:
    """Run a worker body (`body(device, ...)`, as the script's `in_process_group` calls it) with a
    `PayloadCounter` on: {"result": what it returned, "bytes": every byte it handed to dist.all_reduce}.

    Why a wrapper: the body stays plain PyTorch; the counting wraps it from outside, in the worker's process.
    """
    with PayloadCounter() as wire:
        result = body(device, *args, **kwargs)
    return {"result": result, "bytes": wire.bytes}


def percent_change(new_times: list[float], old_times: list[float]) -> tuple[float, tuple[float, float]]:
    """100 x (median(new) / median(old) - 1): how much longer (or, for rates, larger) `new` is, in percent, with
    the interval (in percent) that the two medians' bootstrap intervals allow. Pass 1/rate lists for speeds."""
    import statistics

    low, high = ratio_interval(new_times, old_times)
    return 100 * (statistics.median(new_times) / statistics.median(old_times) - 1), (100 * (low - 1), 100 * (high - 1))


def weak_scaling(model_factory, per_rank: int, sizes: list[int], repeats: int, gpus: int, timeout: float) -> list:
    """Per world size n: the medians of the DDP step, the same step under no_sync (compute only) and the
    all-reduce of its buckets alone; samples/s; and the share of the all-reduce time hidden behind backward,
    1 - (step - compute) / all-reduce (nan at n = 1). Where the largest n exceeds the GPUs every n runs on CPU
    ranks with the GPUs hidden and one thread each (a core is the device: at n = 1 the launcher would give the
    rank every core), so that T_n / (n T_1) compares one kind of device. Rows for
    helpers.plots.training.scaling; "times" holds each variant's repeats, at n = 1 also the plain module's step
    without DDP ("plain"), timed side by side: DDP's own overhead. Every rank's parameters agree (checked)."""
    import statistics

    from helpers.launcher import launch

    rows = []
    # parameters come back for the replicas' check only: the other variants' copies would be sent for nothing
    modes = {m: {"mode": m, "count_buckets": False, "params": m == "step"} for m in ("step", "no_sync", "allreduce")}
    on_cpu = gpus < max(sizes)
    print(f"weak scaling, world sizes {sizes}: " + ("a GPU per rank, NCCL" if not on_cpu else "CPU ranks with gloo, "
          "one core each" + (f" (this machine's {gpus} GPU(s) cannot give each of {max(sizes)} ranks its own)"
                             if gpus else "")))
    for n in sizes:
        variants = {**modes, "plain": {"ddp": None, "params": False}} if n == 1 else modes
        ranks = launch(step_times, model_factory, per_rank, variants, repeats, world_size=n, timeout=timeout,
                       env=cpu_ranks_env(max(sizes), gpus),  # one device kind for every n: T_n / (n T_1) compares
                       threads=1 if on_cpu else None)  # CPU ranks: one core each at every n, n = 1 too
        if not all(torch.equal(r["step"]["params"], ranks[0]["step"]["params"]) for r in ranks):
            raise AssertionError(f"world size {n}: the replicas drifted apart")
        t = {m: statistics.median(ranks[0][m]["times"]) for m in modes}
        rows.append({"world_size": n, "samples_per_s": n * per_rank / t["step"], **t,
                     "times": {m: r["times"] for m, r in ranks[0].items()},
                     "rates": [n * per_rank / s for s in ranks[0]["step"]["times"]],
                     "overlap": 1 - max(0.0, t["step"] - t["no_sync"]) / t["allreduce"] if n > 1 else float("nan")})
    for r in rows:
        r["efficiency"] = r["samples_per_s"] / (r["world_size"] * rows[0]["samples_per_s"])
    return rows


# ----------------------------------------------------------------------------------------------- overlap


def _is_gpu_comm(event: dict) -> bool:
    return event.get("cat") == "kernel" and "nccl" in event.get("name", "").lower()


def _is_gpu_compute(event: dict) -> bool:
    return event.get("cat") == "kernel" and "nccl" not in event.get("name", "").lower()


def traced_step(model_factory, batch_size: int, ddp_kwargs: dict, trace_dir: str, warmup: int = 2,
                seed: int = 0) -> dict:
    """A measurement worker (launch it, or `Workers.run` it; it joins the process group itself): one DDP step
    profiled, and how much of its gradient communication ran while computation ran.

    Why a worker here: the notebook teaches `bucket_cap_mb`; the profiler, the trace file and the interval
    arithmetic (helpers.measure.trace_overlap) are book-keeping around it. The step is profiled after `warmup`
    steps, so DDP has rebuilt its buckets in ready order (what `bucket_plan` predicts). On CPU ranks the spans are
    the profiler's host events (gloo's all-reduces on its own threads, backward's ops on autograd's); on GPU ranks
    the device's kernels (NCCL kernels against the others), since host events only show when work was queued.
    Returns {"trace": the Chrome trace's path (open it in Perfetto), "allreduces": c10d all-reduce calls in the
    step (one per bucket), "overlap": trace_overlap.overlap(...) of this rank's trace}.
    """
    import os

    from helpers.devices import default_backend, rank_device

    os.environ.setdefault("KINETO_LOG_LEVEL", "99")  # the profiler's start/stop lines on every rank: silenced
    device = rank_device()
    backend = default_backend()
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any collective: NCCL's communicator on this rank's own GPU
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    try:
        return _traced(model_factory, batch_size, ddp_kwargs, trace_dir, warmup, seed, device)
    finally:
        gc.collect()  # DDP's reducer died with _traced's frame: nothing holds gloo work at destroy_process_group
        dist.destroy_process_group()


def _traced(model_factory, batch_size, ddp_kwargs, trace_dir, warmup, seed, device) -> dict:
    import os

    from torch.profiler import ProfilerActivity, profile

    from helpers.measure.trace_overlap import is_comm, is_compute, overlap

    x, y = _digits_batch(batch_size, device)
    torch.manual_seed(seed)
    model = torch.nn.parallel.DistributedDataParallel(
        model_factory().to(device), device_ids=[device.index] if device.type == "cuda" else None, **ddp_kwargs)
    for step in range(warmup + 1):  # the last step profiled: by then DDP has rebuilt its buckets in ready order
        if step == warmup:
            dist.barrier()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) if step == warmup else contextlib.nullcontext() as prof:
            torch.nn.functional.cross_entropy(model(x), y).backward()
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    path = os.path.join(trace_dir, f"ddp_step_rank{dist.get_rank()}.json")
    prof.export_chrome_trace(path)
    comm, compute = (_is_gpu_comm, _is_gpu_compute) if device.type == "cuda" else (is_comm, is_compute)
    return {"trace": path, "allreduces": sum(event.name == "c10d::allreduce_" for event in prof.events()),
            "overlap": overlap(path, comm=comm, compute=compute)}
