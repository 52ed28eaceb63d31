# From the PyTorch distributed cookbook: notebooks/09_from_notebook_to_cluster.ipynb, the cells tagged 'script:cluster_ddp.py'.
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
# Run: torchrun --standalone --nproc-per-node=2 cluster_ddp.py --help
"""DDP training that runs unchanged on one node, on several, under SLURM or Kubernetes, and survives restarts.

Every global step trains on the same global batch however many ranks share it (rank r takes rows r::world), so the
result depends on the world size only through float rounding; a DCP checkpoint (get_state_dict/set_state_dict) is
written every --save-every steps and committed with notebook 06's protocol (the recipe's train/checkpoint.py, which
must sit in train/ beside this file), and the script resumes from the newest committed one by itself, which is all
torchrun's restarts and elastic membership changes need.
"""
import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

try:  # notebook 06's commit protocol: the recipe's checkpoint.py, on the path already (a kernel) or in train/ here
    from checkpoint import agreed_latest, commit, settle_staging, staging_dir
except ModuleNotFoundError:
    sys.path.insert(0, str(Path(__file__).resolve().parent / "train"))
    from checkpoint import agreed_latest, commit, settle_staging, staging_dir

ENV_NAMES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "ROLE_WORLD_SIZE",
             "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID")


def global_batch(step, batch, features, seed=0):
    """The batch of one global step: the same on every rank and at every world size."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(batch, features, generator=g)
    y = (x.sin().sum(dim=1, keepdim=True) > 0).float()
    return x, y


def train(ckpt_dir, log_path, device, steps=40, batch=64, features=16, hidden=64, lr=0.05, save_every=5, keep=2,
          step_sleep=0.0, crash_at=-1, crash_rank=1):
    """Train from the latest checkpoint to `steps`; rank 0 logs each step's loss; returns plain values."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = DDP(torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)).to(device),
                device_ids=[device] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if rank == 0:
        Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
        settle_staging(ckpt_dir, keep)  # this job's saves an earlier attempt left: committed if whole, else deleted
    dist.barrier()
    resume = agreed_latest(ckpt_dir)  # rank 0 picks, every rank loads that one
    start = int(resume.name.split("_")[1]) if resume else 0
    if resume:  # DCP reads each rank's view of the state, whatever world size wrote it
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=resume)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    loss_fn = torch.nn.BCEWithLogitsLoss()
    mean = torch.tensor(float("nan") * world)  # a run started after its last step trains nothing: loss nan
    for step in range(start + 1, steps + 1):
        if step == crash_at and rank == crash_rank and attempt == 0:
            raise RuntimeError(f"planted crash on rank {rank} at step {step}")
        x, y = global_batch(step, batch, features)
        loss = loss_fn(model(x[rank::world].to(device)), y[rank::world].to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP averages the gradients over the ranks: the full global batch's gradient
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        saved = step % save_every == 0 or step == steps
        if saved:  # every rank's shards are written when dcp.save returns; rank 0 then commits them
            model_sd, optim_sd = get_state_dict(model, optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=staging_dir(ckpt_dir, step))
            if rank == 0:
                commit(ckpt_dir, step, keep)
        if rank == 0:  # logged after the commit: a line with "saved" true names a committed checkpoint
            with open(log_path, "a") as f:
                f.write(json.dumps({"step": step, "loss": mean.item() / world, "world": world, "saved": saved,
                                    "attempt": attempt, "time": time.time()}) + "\n")
        time.sleep(step_sleep)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    return {"start": start, "loss": mean.item() / world, "world": world, "checksum": flat.double().sum().item(),
            "params": flat.clone()}


def main():
    parser = argparse.ArgumentParser(description="DDP on CPU (gloo) or GPUs, resuming from DCP checkpoints")
    parser.add_argument("--out", default="cluster_ddp_out", help="checkpoints, loss log and per-rank environment")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (to watch elasticity)")
    parser.add_argument("--crash-at", type=int, default=-1, help="rank 1 raises at this step, on attempt 0")
    args = parser.parse_args()
    out = Path(args.out)
    (out / "env").mkdir(parents=True, exist_ok=True)
    local_rank = int(os.environ["LOCAL_RANK"])
    on_gpu = torch.cuda.is_available() and int(os.environ["LOCAL_WORLD_SIZE"]) <= torch.cuda.device_count()
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    if on_gpu:  # also the current device: DCP's object collectives put their tensors there, else all on cuda:0
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo", device_id=device if on_gpu else None)
    try:
        rank = dist.get_rank()
        seen = {name: os.environ.get(name) for name in ENV_NAMES}
        attempt = seen["TORCHELASTIC_RESTART_COUNT"] or "0"
        # one file per worker start (an elastic job starts a rank several times with the same restart count)
        (out / "env" / f"attempt{attempt}_rank{rank}_pid{os.getpid()}.json").write_text(
            json.dumps({**seen, "pid": os.getpid(), "time": time.time()}))
        result = train(str(out / "ckpt"), str(out / "losses.jsonl"), device, steps=args.steps, batch=args.batch,
                       hidden=args.hidden, save_every=args.save_every, step_sleep=args.step_sleep,
                       crash_at=args.crash_at)
        if rank == 0:
            print(f"summary: world={dist.get_world_size()} resumed_from={result['start']} steps={args.steps} "
                  f"loss={result['loss']:.6f} checksum={result['checksum']:.12f}", flush=True)
            torch.save(result["params"], out / "params.pt")
        del result
        gc.collect()
    finally:
        dist.destroy_process_group()

if __name__ == "__main__":
    main()
