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
the cookbook's data/digits.npz (--data names another copy).
"""
import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import parameters_to_vector
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

try:  # the one init_distributed: scripts/train/distributed.py, on the path already (a kernel) or in train/ here
    from distributed import run_distributed
except ModuleNotFoundError:
    sys.path.insert(0, str(Path(__file__).resolve().parent / "train"))
    from distributed import run_distributed

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

if __name__ == "__main__":
    main()
