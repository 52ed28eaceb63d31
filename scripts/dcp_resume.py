# Written by `./cookbook export` from notebooks/06_checkpointing_and_fault_tolerance.ipynb, cells tagged 'script:dcp_resume.py'.
# Edit those cells, not this file. Run: torchrun --standalone --nproc-per-node=2 dcp_resume.py --help
"""Resumable FSDP2 training with Distributed Checkpoint (DCP), from notebook 06 of the cookbook.

Run the same command again after a failure and it resumes from the newest committed checkpoint, bit for bit: model
and optimizer (sharded, so any world size loads them), LR schedule, step, epoch and the data loader's position
(torchdata's StatefulDataLoader). Nothing saved depends on the rank or the device: GPU checkpoints load on CPUs.
"""
import argparse
import gc
import json
import os
import re
import shutil
import signal
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import fully_shard
from torch.utils.data import Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader


class TinyLM(nn.Module):
    """A small decoder-only transformer on bytes (like notebook 03's CharTransformer, of torch's own layers)."""

    def __init__(self, d_model=128, n_layers=2, n_heads=4, seq_len=64, dropout=0.1, vocab=256):
        super().__init__()
        self.tok_emb, self.pos_emb = nn.Embedding(vocab, d_model), nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout,
                                                               batch_first=True, norm_first=True)
                                    for _ in range(n_layers))
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx):
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(x)


class ByteWindows(Dataset):
    """CPython's own language reference (pydoc_data, about 0.8 MB, no download) as windows of bytes."""

    def __init__(self, seq_len=64):
        from pydoc_data.topics import topics
        text = "\n\n".join(topics[k] for k in sorted(topics)).encode()
        self.data, self.seq_len = torch.frombuffer(bytearray(text), dtype=torch.uint8).long(), seq_len

    def __len__(self):
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i):
        window = self.data[i * self.seq_len:(i + 1) * self.seq_len + 1]
        return window[:-1], window[1:]


def rank_device():
    """This rank's GPU when every local rank can have one, else the CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1")):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed():
    """The default group: gloo for CPU tensors plus NCCL for CUDA ones on GPUs (DCP's async_save needs a CPU
    backend), with device_id so NCCL binds this rank's GPU."""
    device = rank_device()
    if device.type == "cuda":
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    return device


class AppState(Stateful):
    """Everything a resumed run needs and nothing that depends on the rank or the device (no RNG state: each step
    reseeds from (seed, rank, step)). DCP calls state_dict() to save and load_state_dict() to load."""

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
        self.loader.sampler.set_epoch(self.epoch)
        self.loader.load_state_dict(json.loads(state["loader"]))


def build(d_model=128, n_layers=2, batch=8, total_steps=100, seed=0, dropout=0.1):
    """Model sharded with FSDP2 over every rank (same weights everywhere), AdamW, cosine LR, and a loader that
    gives each rank its own shard of the data in an order fixed by (seed, epoch)."""
    device = rank_device()
    torch.manual_seed(seed)
    model = TinyLM(d_model, n_layers, dropout=dropout).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    sampler = DistributedSampler(ByteWindows(), seed=seed, drop_last=True)
    with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates
        warnings.filterwarnings("ignore", message=".*set_vital")
        loader = StatefulDataLoader(sampler.dataset, batch_size=batch, sampler=sampler, drop_last=True)
    return AppState(model, optimizer, scheduler, loader), device


def step_dir(root, step):
    return Path(root) / f"step_{step:08d}"


def staging_dir(root, step):
    return Path(root) / f".step_{step:08d}.partial"


def latest(root):
    """The newest committed checkpoint (a `step_*` folder with DCP's `.metadata`), or None."""
    done = [p for p in Path(root).glob("step_*") if re.fullmatch(r"step_\d{8}", p.name) and (p / ".metadata").exists()]
    return max(done, default=None)


def commit(root, step, keep=2):
    """Publish a finished save (one rank, after every rank's save returned): rename its staging folder, atomic
    within a file system, fsync the parent so the rename survives a power cut, then delete all but `keep`."""
    if not (staging_dir(root, step) / ".metadata").exists():
        raise FileNotFoundError(f"the save of step {step} did not finish")
    os.rename(staging_dir(root, step), step_dir(root, step))
    fd = os.open(root, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    for old in sorted(Path(root).glob("step_*"))[:-keep]:
        shutil.rmtree(old)


def train_step(app, x, y, device, seed=0):
    """One optimizer step. Dropout draws from a generator reseeded from (seed, rank, step): a resumed step draws
    the same masks without any generator state in the checkpoint."""
    torch.manual_seed(seed + 1_000_003 * dist.get_rank() + app.step)
    logits = app.model(x.to(device))
    loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten())
    loss.backward()
    app.optimizer.step()
    app.scheduler.step()
    app.optimizer.zero_grad(set_to_none=True)
    app.step += 1
    return loss.item()


def commit_when_written(pending, ckpt_dir, keep):
    """Wait for an async save (its future and step) to be written, then commit it (rank 0)."""
    future, step = pending
    future.result()
    if dist.get_rank() == 0:
        commit(ckpt_dir, step, keep)


def train_from_checkpoint(ckpt_dir, total_steps=40, save_every=10, keep=2, async_save=False, crash_at=None,
                          crash_rank=1, d_model=128, n_layers=2, batch=8, seed=0):
    """Train to `total_steps`, resuming from the newest committed checkpoint under `ckpt_dir` if there is one.
    Saves are committed once complete; an async save is committed at the first step that finds it written.
    `crash_at`: rank `crash_rank` SIGKILLs itself before that step, on torchrun's first attempt only. Each rank
    appends its losses to ckpt_dir/losses.rank<r>.jsonl, which outlives a killed process. Returns plain values."""
    rank, attempt = dist.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    app, device = build(d_model, n_layers, batch, total_steps, seed)
    save_group = dist.new_group(backend="gloo") if async_save else None  # async saves talk on their own group
    resume = latest(ckpt_dir)
    if resume is not None:
        dcp.load({"app": app}, checkpoint_id=resume)
    resumed_from, losses, pending = app.step, {}, None
    if rank == 0:
        for debris in Path(ckpt_dir).glob(".step_*.partial"):  # saves that never finished
            shutil.rmtree(debris)
    dist.barrier()
    app.loader.sampler.set_epoch(app.epoch)
    batches = iter(app.loader)  # continues where the loaded state left it
    with open(Path(ckpt_dir) / f"losses.rank{rank}.jsonl", "a") as log:
        while app.step < total_steps:
            if app.step == crash_at and rank == crash_rank and attempt == 0:
                os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer or a lost node would
            try:
                x, y = next(batches)
            except StopIteration:  # the epoch is over: a new order
                app.epoch += 1
                app.loader.sampler.set_epoch(app.epoch)
                batches = iter(app.loader)
                continue
            loss = train_step(app, x, y, device, seed)
            losses[app.step] = loss
            log.write(json.dumps({"step": app.step, "loss": loss, "attempt": attempt, "time": time.time()}) + "\n")
            log.flush()
            save_now = app.step % save_every == 0 or app.step == total_steps
            if pending is not None and (save_now or pending[0].done()):
                commit_when_written(pending, ckpt_dir, keep)
                pending = None
            if save_now and async_save:
                staging = staging_dir(ckpt_dir, app.step)
                pending = (dcp.async_save({"app": app}, checkpoint_id=staging, process_group=save_group), app.step)
            elif save_now:
                dcp.save({"app": app}, checkpoint_id=staging_dir(ckpt_dir, app.step))  # every rank's shard written
                if rank == 0:
                    commit(ckpt_dir, app.step, keep)
        if pending is not None:
            commit_when_written(pending, ckpt_dir, keep)
    dist.barrier()
    params = {k: v.full_tensor().cpu() for k, v in app.model.state_dict().items()}
    return {"rank": rank, "attempt": attempt, "resumed_from": resumed_from, "losses": losses, "params": params,
            "world_size": dist.get_world_size(), "device": device.type, "epoch": app.epoch,
            "loader": app.loader.state_dict(), "steps_per_epoch": len(app.loader)}


def train(ckpt_dir, **options):
    """The worker, as torchrun or helpers.launch runs it on every rank: the process group, the training in a
    function whose torch objects are all freed when it returns, then gc and destroy: a clean exit every time."""
    init_distributed()
    try:
        return train_from_checkpoint(ckpt_dir, **options)
    finally:
        gc.collect()
        dist.destroy_process_group()


@record  # under torchrun an uncaught exception goes to its error file, with its traceback
def main():
    parser = argparse.ArgumentParser(description="DCP save and resume: checkpoint every --save-every steps; the same "
                                     "command again, at any --nproc-per-node, resumes from the newest committed "
                                     "checkpoint. Under torchrun --max-restarts=N each restart resumes the same way.")
    parser.add_argument("--ckpt-dir", default="checkpoints", help="committed checkpoints; every node must reach it")
    parser.add_argument("--total-steps", type=int, default=200, help="train until this step, across resumes")
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--keep", type=int, default=2, help="committed checkpoints kept")
    parser.add_argument("--async-save", action="store_true", help="dcp.async_save: write while training goes on")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--crash-at", type=int, help="plant a crash: a rank SIGKILLs itself before this step, on "
                        "the first attempt only")
    parser.add_argument("--crash-rank", type=int, default=1)
    args = parser.parse_args()
    os.makedirs(args.ckpt_dir, exist_ok=True)
    result = train(**vars(args))
    if result["rank"] == 0:
        losses = result["losses"]
        print(f"summary: world_size={result['world_size']} device={result['device']} attempt={result['attempt']} "
              f"resumed_from={result['resumed_from']} trained={len(losses)} "
              f"last_loss={losses[max(losses)] if losses else float('nan'):.4f} checkpoint={latest(args.ckpt_dir)}",
              flush=True)

if __name__ == "__main__":
    main()
