# Written by `./cookbook export` from notebooks/06_checkpointing_and_fault_tolerance.ipynb, cells tagged 'script:dcp_resume.py'.
# Edit those cells, not this file. Run: torchrun --standalone --nproc-per-node=2 dcp_resume.py --help
"""Resumable FSDP2 training with Distributed Checkpoint (DCP), from notebook 06 of the cookbook: run the same
command again after a failure (or let torchrun --max-restarts do it) and it resumes from the newest committed
checkpoint. Nothing saved depends on the rank or the device.

At the world size that wrote the checkpoint, the resumed run repeats the uninterrupted one's losses bit for bit (on
CPUs; on GPUs within float rounding). At another world size the model, optimizer, schedule and step load exactly
(so the evaluation loss on any batch is that of the saved model), but training goes on along another trajectory:
DistributedSampler cuts the data into other shards, the global batch is --batch times the new world size, the
dropout masks are keyed by rank, and the loader's saved position (batches drawn per rank) points elsewhere in the
new shards. Rank 0 logs every --log-every steps, with the time left at this pace.

For a project: scripts/train/ adds meta-device init, a GPT at any layout (DDP, HSDP, TP, pipeline), a sampler that
resumes in the same data order at any layout, SIGTERM saves, and export to one file: `scripts/train/train.py`.
"""
import argparse
import gc
import json
import os
import shutil
import signal
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader


class TinyLM(nn.Module):
    """A small decoder-only transformer on bytes (like notebook 03's CharTransformer, of torch's own layers)."""

    def __init__(self, d_model=128, n_layers=2, seq_len=64, dropout=0.1):
        super().__init__()
        self.tok_emb, self.pos_emb = nn.Embedding(256, d_model), nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(d_model, 4, 4 * d_model, dropout, batch_first=True,
                                                               norm_first=True) for _ in range(n_layers))
        self.head = nn.Linear(d_model, 256, bias=False)

    def forward(self, idx):
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(x)


def byte_windows(seq_len=64):
    """CPython's own language reference (pydoc_data, about 0.8 MB, no download) as (bytes, next bytes) windows."""
    from pydoc_data.topics import topics
    text = "\n\n".join(topics[k] for k in sorted(topics)).encode()
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    n = (len(data) - 1) // seq_len
    return TensorDataset(data[:n * seq_len].view(n, seq_len), data[1:n * seq_len + 1].view(n, seq_len))


def init_distributed():
    """The default group and this rank's device: NCCL for CUDA tensors beside gloo for CPU ones (async_save needs
    a CPU backend) when every local rank has a GPU, with device_id so NCCL binds it; else gloo on the CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1")):
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)  # DCP's object collectives use the current device, which device_id leaves
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


def build(device, d_model=128, n_layers=2, batch=8, total_steps=100, seed=0):
    """Model sharded with FSDP2 over every rank (same weights everywhere), AdamW, cosine LR, and a loader that
    gives each rank its own shard of the data in an order fixed by (seed, epoch); all of it in an AppState."""
    torch.manual_seed(seed)
    model = TinyLM(d_model, n_layers).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    sampler = DistributedSampler(byte_windows(), seed=seed, drop_last=True)
    with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates
        warnings.filterwarnings("ignore", message=".*set_vital")
        loader = StatefulDataLoader(sampler.dataset, batch_size=batch, sampler=sampler, drop_last=True)
    return AppState(model, optimizer, scheduler, loader)


def train_step(app, x, y, device, seed=0):
    """One optimizer step, its dropout masks fixed by (seed, rank, step) alone."""
    torch.manual_seed(seed + 1_000_003 * dist.get_rank() + app.step)
    logits = app.model(x.to(device))
    loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten())
    loss.backward()
    app.optimizer.step()
    app.scheduler.step()
    app.optimizer.zero_grad(set_to_none=True)
    app.step += 1
    return loss.item()


class AppState(Stateful):
    """Everything a resumed run needs and nothing that depends on the rank or the device."""

    def __init__(self, model, optimizer, scheduler, loader):
        self.model, self.optimizer, self.scheduler, self.loader = model, optimizer, scheduler, loader
        self.step, self.epoch = 0, 0

    def state_dict(self):
        model_state, optim_state = get_state_dict(self.model, self.optimizer)  # FSDP2's shards as DTensors
        return {"model": model_state, "optim": optim_state, "scheduler": self.scheduler.state_dict(),
                "step": self.step, "epoch": self.epoch, "loader": json.dumps(self.loader.state_dict())}

    def load_state_dict(self, state):
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.epoch = state["step"], state["epoch"]
        self.loader.load_state_dict(json.loads(state["loader"]))


def staging_dir(root, step):
    """Where the save of `step` is written: a dot-folder that `latest` never picks."""
    return Path(root) / f".step_{step:08d}.partial"


def latest(root):
    """The newest committed checkpoint (a `step_<8 digits>` folder with DCP's `.metadata`), or None."""
    return max((p for p in Path(root).glob("step_" + "[0-9]" * 8) if (p / ".metadata").exists()), default=None)


def commit(root, step, keep=2):
    """Publish a finished save (one rank, after every rank's save returned): rename its staging folder, atomic
    within a file system, fsync the parent so the rename survives a power cut, then delete all but `keep`."""
    if not (staging_dir(root, step) / ".metadata").exists():
        raise FileNotFoundError(f"the save of step {step} did not finish")
    os.rename(staging_dir(root, step), Path(root) / f"step_{step:08d}")
    fd = os.open(root, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    for old in sorted(Path(root).glob("step_*"))[:-keep]:
        shutil.rmtree(old)


def clear_staging(root):
    """Delete the staging folders of saves that never finished (one rank, before any rank saves again)."""
    for debris in Path(root).glob(".step_*.partial"):
        shutil.rmtree(debris)


def make_stager(device):
    """On GPUs one stager for the run, its pinned CPU copy of the state allocated at the first save and refilled at
    every later one. On CPUs None: async_save's default staging (torch 2.11 reuses no copy without pinned memory)."""
    return BlockingAsyncStager(cache_staged_state_dict=True) if device.type == "cuda" else None


def commit_when_written(future, step, ckpt_dir, keep):
    """Wait until an async save is written on this rank; rank 0 then publishes it."""
    future.result()
    if dist.get_rank() == 0:
        commit(ckpt_dir, step, keep)


def train_from_checkpoint(ckpt_dir, device, total_steps=40, save_every=10, keep=2, crash_at=None, d_model=128,
                          n_layers=2, batch=8, seed=0, log_every=0):
    """Train to `total_steps`, resuming from the newest committed checkpoint under `ckpt_dir` if there is one.
    `crash_at`: the last rank SIGKILLs itself after that step, on torchrun's first attempt only. Each rank
    appends its losses to ckpt_dir/losses.rank<r>.jsonl, which outlives a killed process; rank 0 prints its loss,
    the elapsed and the estimated remaining seconds every `log_every` steps (0: never). Returns plain values."""
    rank, attempt = dist.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    os.makedirs(ckpt_dir, exist_ok=True)
    app = build(device, d_model, n_layers, batch, total_steps, seed)
    save_group, stager = dist.new_group(backend="gloo"), make_stager(device)  # async saves talk on their own group
    if (resume := latest(ckpt_dir)) is not None:
        dcp.load({"app": app}, checkpoint_id=resume)
    resumed_from, losses, pending = app.step, {}, None
    if rank == 0:
        clear_staging(ckpt_dir)
    dist.barrier()  # the debris is gone before any rank stages a save
    start = time.perf_counter()
    with open(Path(ckpt_dir) / f"losses.rank{rank}.jsonl", "a", buffering=1) as log:  # each line written at once
        while app.step < total_steps:
            app.loader.sampler.set_epoch(app.epoch)  # this epoch's order, a loaded epoch's too
            for x, y in app.loader:  # after a load: from the first batch of this epoch not yet trained on
                if app.step == crash_at and rank == dist.get_world_size() - 1 and attempt == 0:
                    os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer or a lost node would
                loss = train_step(app, x, y, device, seed)
                losses[app.step] = loss
                print(json.dumps(dict(step=app.step, loss=loss, attempt=attempt, time=time.time())), file=log)
                if rank == 0 and log_every and (app.step % log_every == 0
                                                or app.step in (resumed_from + 1, total_steps)):
                    took = time.perf_counter() - start
                    left = took / (app.step - resumed_from) * (total_steps - app.step)
                    print(f"step {app.step:>5}/{total_steps}  loss {loss:.4f}  {took:.1f} s, about {left:.0f} s left",
                          flush=True)
                save_now = app.step % save_every == 0 or app.step == total_steps
                if pending is not None and (save_now or pending[0].done()):
                    commit_when_written(*pending, ckpt_dir, keep)
                    pending = None
                if save_now:
                    pending = (dcp.async_save({"app": app}, checkpoint_id=staging_dir(ckpt_dir, app.step),
                                              process_group=save_group, async_stager=stager), app.step)
                if app.step == total_steps:
                    break
            else:  # the epoch is over: the next one, in a new order
                app.epoch += 1
    if pending is not None:
        commit_when_written(*pending, ckpt_dir, keep)
    params = {k: v.full_tensor().cpu() for k, v in app.model.state_dict().items()}
    return {"rank": rank, "attempt": attempt, "resumed_from": resumed_from, "losses": losses, "params": params,
            "world_size": dist.get_world_size(), "device": device.type, "loader": app.loader.state_dict(),
            "steps_per_epoch": len(app.loader)}


def train(ckpt_dir, **options):
    """The worker: every torch object lives in train_from_checkpoint and is freed before the group is destroyed."""
    device = init_distributed()
    if "d_model" in options and options["d_model"] is None:  # main()'s default: what fits this device
        options["d_model"] = 512 if device.type == "cuda" else 128
    try:
        return train_from_checkpoint(ckpt_dir, device, **options)
    finally:
        gc.collect()
        dist.destroy_process_group()


@record  # under torchrun an uncaught exception goes to its error file, with its traceback
def main():
    parser = argparse.ArgumentParser(description="FSDP2 training, saved with DCP every --save-every steps; run again "
                                     "(at any --nproc-per-node) or restarted, it resumes from the newest checkpoint.")
    parser.add_argument("--ckpt-dir", default="checkpoints", help="committed checkpoints; every node must reach it")
    parser.add_argument("--total-steps", type=int, default=200, help="train until this step, across resumes")
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--d-model", type=int, help="default: 512 on GPUs, 128 on CPUs (a minute or two on two cores)")
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--log-every", type=int, default=10, help="rank 0 prints step, loss, time (0: never)")
    parser.add_argument("--crash-at", type=int, help="plant a crash: the last rank SIGKILLs itself after this "
                        "step, on the first attempt only")
    args = parser.parse_args()
    result = train(**vars(args))
    if result["rank"] == 0:
        print(f"summary: world_size={result['world_size']} device={result['device']} attempt={result['attempt']} "
              f"resumed_from={result['resumed_from']} trained={len(result['losses'])} "
              f"last_loss={result['losses'].get(args.total_steps, float('nan')):.4f} "
              f"checkpoint={latest(args.ckpt_dir)}", flush=True)


def held_bytes(tree):
    """Bytes of the tensors this rank holds in a nested state (a DTensor counts its local shard)."""
    if isinstance(tree, dict):
        return sum(held_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(held_bytes(v) for v in tree)
    if isinstance(tree, torch.distributed.tensor.DTensor):
        tree = tree.to_local()
    return tree.numel() * tree.element_size() if isinstance(tree, torch.Tensor) else 0


def write_and_fsync(path, nbytes, block=os.urandom(8 << 20)):
    """The disk's own cost: write `nbytes` to a new file, fsync it (as FileSystemWriter's sync_files does)."""
    with open(path, "wb") as f:
        for start in range(0, nbytes, len(block)):
            f.write(block[:nbytes - start])
        f.flush()
        os.fsync(f.fileno())
    os.unlink(path)


def save_costs(root, d_model=384, n_layers=4, repeats=3, threads=4):
    """The worker of "Measure it": seconds of each way to save, per repeat, on this rank (plain values)."""
    device = init_distributed()
    try:
        app = build(device, d_model, n_layers)
        train_step(app, *next(iter(app.loader)), device)  # both Adam moments exist
        return time_saves({"app": app.state_dict()}, device, Path(root), repeats, threads)
    finally:
        gc.collect()
        dist.destroy_process_group()


def time_saves(state, device, root, repeats, threads):
    """Interleaved repeats of every operation on the same state; each starts on all ranks at once."""
    rank, gpu = dist.get_rank(), device.type == "cuda"
    root.mkdir(parents=True, exist_ok=True)
    save_group, stager, times, on_disk = dist.new_group(backend="gloo"), make_stager(device), {}, 0

    sync = torch.cuda.synchronize if gpu else (lambda: None)  # a GPU's queued work counts where it is done

    def clock(op, fn, before=0.0):
        dist.barrier()
        sync()
        start = time.perf_counter()
        out = fn()
        sync()
        times.setdefault(op, []).append(before + time.perf_counter() - start)
        return out

    for i in range(repeats):
        sync_dir = root / f"sync{i}"
        clock("disk write + fsync", lambda: write_and_fsync(root / f"disk{rank}_{i}", held_bytes(state)))
        clock("dcp.save", lambda: dcp.save(state, checkpoint_id=sync_dir))
        clock(f"dcp.save, {threads} writer threads",
              lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(root / f"threads{i}", thread_count=threads)))
        for name, options in (("default stager", {}), ("pinned reused stager", {"async_stager": stager})):
            if name != "default stager" and stager is None:  # CPUs: no pinned memory, the default staging only
                continue
            blocking = f"async_save, {name} (blocking)"
            future = clock(blocking, lambda: dcp.async_save(
                state, checkpoint_id=root / f"{name.split()[0]}{i}", process_group=save_group, **options))
            clock(f"async_save, {name} (until written)", future.result, before=times[blocking][-1])
        clock("dcp.load", lambda: dcp.load(state, checkpoint_id=sync_dir))
        dist.barrier()
        if rank == 0:
            on_disk = on_disk or sum(p.stat().st_size for p in sync_dir.iterdir())
            for folder in root.glob(f"*{i}"):
                shutil.rmtree(folder)
    return {"times": times, "held_bytes": held_bytes(state), "on_disk": on_disk, "device": str(device)}

if __name__ == "__main__":
    main()
