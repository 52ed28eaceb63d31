# From the PyTorch distributed cookbook: notebooks/02_ddp.ipynb, the cells tagged 'script:ddp_bench.py'.
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
# Run: torchrun --standalone --nproc-per-node=2 ddp_bench.py --help
"""Timing DDP on the digits, for torchrun: the measuring workers of notebooks 02 and 02b, verbatim.

    torchrun --standalone --nproc-per-node=2 ddp_bench.py --caps 1 25 100

Times one training step of train_ddp.py's DigitsMLP under DDP at each bucket cap, and the same step under no_sync
(compute only), every rank starting together; prints the medians. The workers (step_times, traced_step,
loader_throughput) are bodies for train_ddp.py's run_distributed, as the notebooks launch them; bucket_plan
predicts the buckets DDP makes of a model.
"""
import argparse
import contextlib
import functools
import gc
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import parameters_to_vector
from torch.utils.data import DataLoader

from train_ddp import DIGITS, DigitsMLP, load_digits, run_distributed


def bucket_plan(model, bucket_cap_mb=None):
    """Bytes of each bucket DDP all-reduces per step from its second iteration on (fp32 gradients, one device).

    The first iteration uses one bucket: DDP does not know yet in which order the gradients become ready. It then
    rebuilds the buckets in that order, for a model whose forward uses its parameters in registration order the
    reverse of model.parameters(). A gradient joins the open bucket, and the bucket closes as soon as it holds at
    least its cap (so it may pass the cap by one tensor). An explicit bucket_cap_mb caps every bucket; the default
    (None: 25 MiB) caps the first at 1 MiB, so that the first all-reduce starts early."""
    if bucket_cap_mb is None:  # DDP's first-bucket size has no public name
        caps = [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 2**20]
    else:
        caps = [int(bucket_cap_mb * 2**20)]
    buckets, open_bytes = [], 0
    for p in reversed([p for p in model.parameters() if p.requires_grad]):
        open_bytes += p.numel() * p.element_size()
        if open_bytes >= caps[min(len(buckets), len(caps) - 1)]:
            buckets.append(open_bytes)
            open_bytes = 0
    return buckets + [open_bytes] if open_bytes else buckets


def rank_batch(batch_size, device, data=DIGITS):
    """The first `batch_size` training digits of this rank's share (rank r takes every world-th sample)."""
    x, y = load_digits(data)[0].tensors
    rank, world = dist.get_rank(), dist.get_world_size()
    index = torch.arange(rank, rank + batch_size * world, world) % len(y)
    return x[index].to(device), y[index].to(device)


def timed_call(step, device):
    """Seconds of one call of step(), every rank starting together after a barrier: CUDA events on a GPU (the
    GPU's own clock), else wall time with the device idle at both ends."""
    if device.type != "cuda":
        dist.barrier()
        start = time.perf_counter()
        step()
        return time.perf_counter() - start
    torch.cuda.synchronize(device)
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def bucket_bytes(model, x, y):
    """Bytes of each bucket DDP hands to its all-reduce, counted by a comm hook on `model` (a DDP copy kept for
    counting), in its second iteration: the first uses one bucket, then DDP rebuilds them in ready order."""
    seen = []

    def counting_allreduce(state, bucket):
        seen.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return allreduce_hook(state, bucket)  # what DDP does without a hook: all-reduce, divide by the world size

    model.register_comm_hook(None, counting_allreduce)
    for _ in range(2):
        seen.clear()
        F.cross_entropy(model(x), y).backward()
    return list(seen)


def variant_step(spec, model_factory, x, y, device, seed):
    """(the module, one step of the variant) for a `step_times` variant (its docstring lists the keys)."""
    mode, ddp_kwargs, accum = spec.get("mode", "step"), spec.get("ddp", {}), spec.get("accum", 1)
    torch.manual_seed(seed)
    module = spec.get("factory", model_factory)().to(device)
    model = module if ddp_kwargs is None else DDP(module, device_ids=[device.index] if device.type == "cuda" else None,
                                                  **ddp_kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    grads = [p for p in module.parameters() if p.requires_grad]
    flat = [torch.zeros(b // 4, device=device) for b in spec.get("bucket_bytes", [])]  # mode "allreduce"

    def step():
        optimizer.zero_grad()
        if mode == "allreduce":  # only the all-reduces of DDP's buckets, no compute
            for t in flat:
                dist.all_reduce(t)
            return
        for micro in range(accum):  # accum > 1: gradient accumulation, all-reduce on the last only
            with model.no_sync() if mode in ("no_sync", "delayed") or micro < accum - 1 else contextlib.nullcontext():
                F.cross_entropy(model(x), y).backward()
        if mode == "delayed":  # all compute first, then one all-reduce of every gradient
            buffer = torch.cat([p.grad.reshape(-1) for p in grads])
            dist.all_reduce(buffer)
            torch.nn.utils.vector_to_parameters(buffer / dist.get_world_size(), [p.grad for p in grads])
        optimizer.step()

    return module, step


def step_times(device, model_factory, batch_size, variants, repeats, seed=0, warmup=2, memory_probe=None,
               data=DIGITS):
    """Times variants of one training step on every rank: a body for run_distributed(step_times, ...).

    model_factory(): the module, built after torch.manual_seed(seed), so every variant starts from the same weights.
    variants[label] = {"ddp": DDP kwargs, or None for the plain module; "mode": "step" (forward, backward, SGD
    step), "no_sync" (the same step, DDP's all-reduce skipped: compute only), "delayed" (backward under no_sync,
    then one all-reduce of all gradients), or "allreduce" (only all-reduces of "bucket_bytes", a list of sizes);
    "accum": micro-batches per step (no_sync on all but the last); "factory": another model_factory; "memory":
    also the peak bytes one step holds (CUDA's allocator statistics; on CPU `memory_probe()`, a context manager
    with a .peak, if given); "count_buckets" (default True for DDP); "params" (default True: the trained
    parameters come back); "group": variants of one group are built together and timed in turn, repeat after
    repeat, so that a load that comes and goes hits them alike; groups run one after another, each freed first}.
    Returns per label: "times" (seconds per repeat), "buckets", "peak_bytes", "params" where asked.
    """
    x, y = rank_batch(batch_size, device, data)
    out, groups = {label: {"times": []} for label in variants}, {}
    for label, spec in variants.items():
        groups.setdefault(spec.get("group"), []).append(label)
    for labels in groups.values():
        built = {label: variant_step(variants[label], model_factory, x, y, device, seed) for label in labels}
        for _ in range(warmup):
            for _, step in built.values():
                step()
        for _ in range(repeats):
            for label, (_, step) in built.items():
                out[label]["times"].append(timed_call(step, device))
        for label, (module, step) in built.items():
            spec = variants[label]
            if spec.get("memory") and (device.type == "cuda" or memory_probe):
                out[label]["peak_bytes"] = step_peak_bytes(step, device, memory_probe)
            if spec.get("params", True):
                out[label]["params"] = parameters_to_vector(module.parameters()).detach().cpu()
            if spec.get("ddp", {}) is not None and spec.get("count_buckets", True):
                torch.manual_seed(seed)  # a fresh DDP copy: the counting hook stays out of the timed model
                fresh = spec.get("factory", model_factory)().to(device)
                out[label]["buckets"] = bucket_bytes(DDP(fresh, device_ids=[device.index] if device.type == "cuda"
                                                         else None, **spec.get("ddp", {})), x, y)
        del built
        gc.collect()
    return out


def step_peak_bytes(step, device, probe=None):
    """Peak bytes one step() holds beyond what was allocated before it: the caching allocator's statistics on a
    GPU (they see what DDP's C++ reducer allocates too), else `probe()`'s peak."""
    if device.type != "cuda":
        with probe() as live:
            step()
        return live.peak
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def traced_step(device, model_factory, batch_size, ddp_kwargs, trace_dir, warmup=2, seed=0, data=DIGITS):
    """One DDP step profiled on every rank, after `warmup` steps (DDP has rebuilt its buckets in ready order by
    then): a body for run_distributed(traced_step, ...). Returns {"trace": this rank's Chrome trace (open it in
    Perfetto), "allreduces": c10d all-reduce calls in the step (one per bucket), "device": "cpu" or "cuda"}."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "99")  # the profiler's start/stop lines on every rank: silenced
    x, y = rank_batch(batch_size, device, data)
    torch.manual_seed(seed)
    model = DDP(model_factory().to(device), device_ids=[device.index] if device.type == "cuda" else None, **ddp_kwargs)
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for step in range(warmup + 1):
        if step == warmup:
            dist.barrier()
        with torch.profiler.profile(activities=activities) if step == warmup else contextlib.nullcontext() as prof:
            F.cross_entropy(model(x), y).backward()
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    path = os.path.join(trace_dir, f"ddp_step_rank{dist.get_rank()}.json")
    prof.export_chrome_trace(path)
    return {"trace": path, "allreduces": sum(event.name == "c10d::allreduce_" for event in prof.events()),
            "device": device.type}


def loader_throughput(settings, batch_size, batches, repeats, data=DIGITS):
    """Samples per second each DataLoader setting delivers to this process's device (world size 1, no process
    group), per repeat: settings[label] = DataLoader keyword arguments (num_workers, pin_memory, prefetch_factor,
    persistent_workers...). A repeat iterates `batches` batches from a fresh iterator; the first pass starts the
    workers and is not timed. On a GPU each batch is copied there (non_blocking overlaps only from pinned memory)."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dataset, out = load_digits(data)[0], {}
    for label, kwargs in settings.items():
        loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, **kwargs)
        rates = []
        for _ in range(repeats + 1):
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


def main():
    parser = argparse.ArgumentParser(description="Time a DDP step per bucket cap, and compute alone (run with torchrun)")
    parser.add_argument("--caps", type=float, nargs="+", default=[1, 25, 100], help="bucket_cap_mb values")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--data", default=str(DIGITS), help="the digits (.npz with 'images' and 'labels')")
    args = parser.parse_args()
    variants = {f"bucket_cap_mb={cap:g}": {"ddp": {"bucket_cap_mb": cap}, "params": False} for cap in args.caps}
    variants["no_sync (compute only)"] = {"ddp": {}, "mode": "no_sync", "params": False, "count_buckets": False}
    times = run_distributed(step_times, functools.partial(DigitsMLP, args.hidden, args.depth), args.batch_size,
                            variants, args.repeats, data=args.data)
    if int(os.environ.get("RANK", 0)) == 0:
        medians = {label: statistics.median(r["times"]) * 1e3 for label, r in times.items()}
        print("summary: world_size={} ".format(os.environ.get("WORLD_SIZE", 1))
              + " ".join(f"{label}: {ms:.2f} ms" for label, ms in medians.items()), flush=True)

if __name__ == "__main__":
    main()
