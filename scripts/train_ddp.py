# From the PyTorch distributed cookbook: notebooks/02_ddp.ipynb, the cells tagged 'script:train_ddp.py'.
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
# Run: torchrun --standalone --nproc-per-node=2 train_ddp.py --help
"""DDP training of a small MLP on the 8x8 handwritten digits, for torchrun: notebook 02's cells, verbatim.

    torchrun --standalone --nproc-per-node=2 train_ddp.py --epochs 10 --accum 2

One process per GPU with NCCL (its GPU made the current device, device_id set), or CPU processes with gloo. Every
rank starts from the same weights; DistributedSampler gives each rank its own shard, reshuffled every epoch by
set_epoch; gradients of --accum micro-batches add up under no_sync and are all-reduced once per optimizer step;
rank 0 writes the checkpoint (model.module.state_dict(): no 'module.' prefix, loads without DDP). The digits are
the cookbook's data/digits.npz (--data names another copy). The end of the file holds the measuring workers of
notebooks 02 and 02b (step_times, traced_step, loader_throughput).
"""
import argparse
import contextlib
import gc
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import parameters_to_vector
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

# data/ sits beside scripts/ (this file) and beside notebooks/ (a notebook kernel's working directory)
DIGITS = (Path(__file__).parent if "__file__" in globals() else Path.cwd()).resolve().parent / "data" / "digits.npz"


def load_digits(path=DIGITS, test_fraction=0.2, seed=0):
    """(train, test) TensorDatasets of the 1,797 digits: 8x8 images of pixels 0..16, scaled to [0, 1]."""
    if not Path(path).exists():
        raise SystemExit(f"no digits at {path}: pass --data with the path of the cookbook's data/digits.npz")
    with np.load(path) as saved:
        images, labels = saved["images"], saved["labels"]
    x = torch.tensor(images.reshape(len(images), -1), dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    test, train = order[:int(len(y) * test_fraction)], order[int(len(y) * test_fraction):]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


class DigitsMLP(nn.Module):
    """64 pixels -> `depth` hidden layers of `hidden` units (ReLU, optional dropout) -> 10 classes."""

    def __init__(self, hidden=256, depth=2, dropout=0.0):
        super().__init__()
        layers, width = [], 64
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()] + ([nn.Dropout(dropout)] if dropout else [])
            width = hidden
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        return self.head(self.body(x))


def init_distributed():
    """Join the group torchrun describes (RANK, WORLD_SIZE, ...); NCCL where every local rank has a GPU of its own,
    else gloo on CPU. Returns this rank's device."""
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.is_available() and local_world <= torch.cuda.device_count():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # the current device: object collectives and DCP put their tensors there
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def run_distributed(body, *args, **kwargs):
    """One rank's whole life: join, run body(device, ...), free what it built, leave (also after an error).

    body returns plain values (numbers, lists, CPU tensors), so DDP's reducer and the optimizer die with its
    frame; gc.collect() reaps what cycles keep, before destroy_process_group(). Skipping this made a gloo job
    abort at exit now and then ("terminate called without an active exception").
    """
    device = init_distributed()
    try:
        return body(device, *args, **kwargs)
    finally:
        gc.collect()
        dist.destroy_process_group()


def shard_loader(dataset, batch_size, seed=0, **loader_kwargs):
    """This rank's batches: the same seeded permutation on every rank, a disjoint slice each; call
    sampler.set_epoch(epoch) every epoch or every epoch replays the first one's order."""
    sampler = DistributedSampler(dataset, shuffle=True, seed=seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, **loader_kwargs), sampler


def replicated_model(device, hidden, depth, seed=0, dropout=0.0, **ddp_kwargs):
    """DDP(DigitsMLP) with the same initial weights on every rank; afterwards a random stream per rank."""
    torch.manual_seed(seed)  # same weights everywhere (DDP would broadcast rank 0's anyway)
    module = DigitsMLP(hidden, depth, dropout).to(device)
    model = DDP(module, device_ids=[device.index] if device.type == "cuda" else None, **ddp_kwargs)
    torch.manual_seed(seed + 1 + dist.get_rank())  # dropout and augmentation differ per rank
    return model


def train_step(model, optimizer, micro_batches, device, sync_every_micro_batch=False):
    """One optimizer step over micro-batches [(x, y), ...]: gradients add up in .grad, and DDP all-reduces once,
    in the last backward (no_sync before it; forward belongs inside no_sync too). Returns the mean loss."""
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last or sync_every_micro_batch else model.no_sync():
            loss = F.cross_entropy(model(x.to(device)), y.to(device)) / len(micro_batches)
            loss.backward()
        total += loss.item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


@torch.no_grad()
def accuracy(model, dataset, device):
    """Fraction of `dataset` classified correctly (the plain module, in eval mode, then back to train mode)."""
    model.eval()
    x, y = dataset.tensors
    correct = (model(x.to(device)).argmax(dim=1) == y.to(device)).sum().item()
    model.train()
    return correct / len(y)


def fit(device, epochs, batch_size, accum, lr, hidden, depth, checkpoint=None, seed=0, dropout=0.0, warmup_steps=0,
        data=DIGITS, log=False):
    train_set, test_set = load_digits(data)
    loader, sampler = shard_loader(train_set, batch_size, seed)
    model = replicated_model(device, hidden, depth, seed, dropout)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    # a large global batch with its lr scaled up diverges early: ramp the lr up linearly (Goyal et al. 2017)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, 1 / max(warmup_steps, 1), total_iters=warmup_steps)
    losses, curve, started = [], [], time.perf_counter()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        batches = iter(loader)
        for _ in range(len(loader) // accum):
            losses.append(train_step(model, optimizer, [next(batches) for _ in range(accum)], device))
            warmup.step()
        curve.append(accuracy(model.module, test_set, device))  # test accuracy after each epoch
        if log and dist.get_rank() == 0:
            print(f"epoch {epoch + 1}/{epochs}: loss {losses[-1]:.4f}, test accuracy {curve[-1]:.3f}, "
                  f"{time.perf_counter() - started:.0f} s so far", flush=True)
    restored = None
    if checkpoint:
        if dist.get_rank() == 0:
            torch.save(model.module.state_dict(), checkpoint)
        dist.barrier()  # the file is complete before any rank reads it
        saved = torch.load(checkpoint, map_location=device)
        restored = all(torch.equal(saved[k], v) for k, v in model.module.state_dict().items())
    return {"losses": losses, "curve": curve, "accuracy": curve[-1], "restored": restored,
            "params": parameters_to_vector(model.parameters()).detach().cpu()}


def main():
    parser = argparse.ArgumentParser(description="DDP training of an MLP on the digits (run it with torchrun)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16, help="samples per rank per micro-batch")
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step (no_sync)")
    parser.add_argument("--lr", type=float, default=0.04, help="SGD with momentum 0.9")
    parser.add_argument("--warmup-steps", type=int, default=0, help="linear lr warm-up, for a large global batch")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default="digits_mlp.pt", help="written by rank 0 (a shared path on nodes)")
    parser.add_argument("--data", default=str(DIGITS), help="the digits (.npz with 'images' and 'labels')")
    args = parser.parse_args()
    result = run_distributed(fit, args.epochs, args.batch_size, args.accum, args.lr, args.hidden, args.depth,
                              args.checkpoint, args.seed, args.dropout, args.warmup_steps, args.data, log=True)
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"summary: world_size={os.environ.get('WORLD_SIZE', 1)} steps={len(result['losses'])} "
              f"final_loss={result['losses'][-1]:.4f} test_accuracy={result['accuracy']:.3f} "
              f"checkpoint={args.checkpoint} restored={result['restored']}", flush=True)


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

if __name__ == "__main__":
    main()
