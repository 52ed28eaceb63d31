# Written by `./cookbook export` from notebooks/03_fsdp_and_device_mesh.ipynb, cells tagged 'script:train_fsdp.py'.
# Edit those cells, not this file. Run: torchrun --standalone --nproc-per-node=2 train_fsdp.py --help
"""Train a small character-level transformer with FSDP2 (`fully_shard`) on a named DeviceMesh.

    torchrun --standalone --nproc-per-node=2 train_fsdp.py --steps 300          # CPU (gloo) or one GPU each (NCCL)
    torchrun --standalone --nproc-per-node=4 train_fsdp.py --hsdp --bf16        # 2 x 2 mesh ("replicate", "shard")

Plain PyTorch and the standard library only: the corpus is CPython's language reference (pydoc_data), one token per
character. Every rank starts from the same weights (one seed) and draws its own batches (a seed per rank). The
defaults take a minute or two on two CPU cores; rank 0 logs every --log-every steps, with the time left.

For a project: scripts/train/ adds meta-device init, a GPT, HSDP at any degree, bf16 with clipping, warm-up and
cosine decay, evaluation and DCP checkpoints: `torchrun --standalone --nproc-per-node=2 scripts/train/train.py`.
"""
import argparse
import gc
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


def init_distributed() -> torch.device:
    """The process group from torchrun's environment: NCCL on this rank's own GPU (passed as device_id) where every
    local rank has one, with gloo beside it for CPU tensors; else gloo on the CPU. Returns the device this rank
    computes on."""
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.is_available() and local_world <= torch.cuda.device_count():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # gloo for CPU tensors: with CPUOffloadPolicy the gradients live on the CPU, and clip_grad_norm_ all-reduces
        # their norms there, which NCCL alone refuses ("No backend type associated with device type cpu")
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def run_distributed(body, *args, **kwargs):
    """The worker: process group, `body(device, *args, **kwargs)`, a clean exit. `body` returns plain values only,
    so the models, optimizers and gradients it made (and the collective work they hold) are freed before the group
    is destroyed: gloo work that outlives its group can abort the process at exit."""
    device = init_distributed()
    try:
        return body(device, *args, **kwargs)
    finally:
        gc.collect()
        dist.destroy_process_group()


def make_mesh(device: torch.device, hsdp: bool = False) -> DeviceMesh:
    """1-D mesh ("dp",) over every rank; with hsdp a 2-D mesh: shard inside a row, replicate across rows."""
    world = dist.get_world_size()
    if hsdp:
        return init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, **fsdp_kwargs) -> nn.Module:
    """One FSDP group per block, then the root (embeddings, final norm, head): bottom-up, the torchtitan way."""
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **fsdp_kwargs)
    fully_shard(model, mesh=mesh, **fsdp_kwargs)
    return model


def accumulate_and_clip(model: nn.Module, micro_batches: list, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward over one optimizer step's micro-batches, the gradients reduce-scattered after the last
    one only; then clip. Returns the summed loss and the total gradient norm (a DTensor under FSDP)."""
    losses = []
    for i, (x, y) in enumerate(micro_batches):
        model.set_requires_gradient_sync(i == len(micro_batches) - 1)   # FSDP1's and DDP's no_sync() on the others
        loss = cross_entropy(model(x), y) / len(micro_batches)
        loss.backward()
        losses.append(loss.detach())
    return sum(losses), torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)   # shard norms, one all-reduce


def set_prefetch(model: nn.Module) -> None:
    """Explicit prefetch: block i's forward issues block i+1's all-gather; block i+1's backward issues block i's."""
    blocks = list(model.blocks)
    for current, following in zip(blocks, blocks[1:]):
        current.set_modules_to_forward_prefetch([following])
        following.set_modules_to_backward_prefetch([current])


class CharTransformer(nn.Module):
    """A decoder-only transformer made of torch's own layers; `blocks` is a ModuleList: one FSDP group each."""

    def __init__(self, vocab_size: int, d_model: int = 128, n_layers: int = 4, n_heads: int = 4, seq_len: int = 64):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-character loss on float32 logits: under bf16 compute the softmax's sum is not done in bf16."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def char_corpus() -> tuple[torch.Tensor, list[str]]:
    """CPython's language reference as one tensor of character ids, and the characters (the vocabulary)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text]), chars


def random_windows(tokens: torch.Tensor, batch: int, seq_len: int, generator: torch.Generator):
    """`batch` random (input, next-character target) windows of the corpus, reproducible from `generator`."""
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch,), generator=generator).tolist()
    x = torch.stack([tokens[s:s + seq_len] for s in starts])
    return x, torch.stack([tokens[s + 1:s + seq_len + 1] for s in starts])


def train_steps(device: torch.device, tokens: torch.Tensor, vocab_size: int, steps: int = 300, batch: int = 16,
                accum: int = 1, seq_len: int = 64, d_model: int = 128, layers: int = 4, lr: float = 3e-3,
                clip: float = 1.0, bf16: bool = False, hsdp: bool = False, seed: int = 0, log_every: int = 0) -> dict:
    """FSDP2 training; every torch object lives in here and is freed when this returns plain values. Rank 0 prints
    step, loss, elapsed and remaining seconds every `log_every` steps (0: never)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = make_mesh(device, hsdp)
    torch.manual_seed(seed)                                     # the same initial weights on every rank
    model = CharTransformer(vocab_size, d_model, layers, seq_len=seq_len).to(device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()                             # bf16 compute, fp32 gradient reduction
    apply_fsdp(model, mesh, mp_policy=mp)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(1_000_003 * (seed + 1) + rank)   # each rank its own batches
    losses, norms, start = [], [], time.perf_counter()
    for step in range(steps):                                   # gradient accumulation over `accum` micro-batches
        micro_batches = [[t.to(device) for t in random_windows(tokens, batch, seq_len, gen)] for _ in range(accum)]
        step_loss, norm = accumulate_and_clip(model, micro_batches, clip)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(step_loss)                              # SUM (gloo has no AVG), then / world
        losses.append(step_loss.item() / world)
        norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).item())
        if rank == 0 and log_every and ((step + 1) % log_every == 0 or step + 1 in (1, steps)):
            took = time.perf_counter() - start
            print(f"step {step + 1:>5}/{steps}  loss {losses[-1]:.4f}  {took:.1f} s, about "
                  f"{took / (step + 1) * (steps - step - 1):.0f} s left", flush=True)
    return {"losses": losses, "grad_norms": norms, "world_size": world, "device": str(device),
            "mesh": list(mesh.mesh_dim_names), "param_dtype": "bfloat16" if bf16 else "float32"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16, help="sequences per rank and micro-batch")
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip", type=float, default=1.0, help="max gradient norm")
    parser.add_argument("--bf16", action="store_true", help="MixedPrecisionPolicy: bf16 compute, fp32 reduction")
    parser.add_argument("--hsdp", action="store_true", help='2-D mesh ("replicate", "shard"): an even world size')
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=25, help="rank 0 prints step, loss, time (0: never)")
    args = parser.parse_args()
    tokens, chars = char_corpus()
    result = run_distributed(train_steps, tokens, len(chars), **vars(args))
    if int(os.environ.get("RANK", 0)) == 0:
        losses = result["losses"]
        tail = losses[-max(1, len(losses) // 10):]
        print("summary: " + json.dumps({"first_loss": losses[0], "final_loss": sum(tail) / len(tail),
                                        "steps": len(losses), "world_size": result["world_size"],
                                        "device": result["device"], "mesh": result["mesh"],
                                        "param_dtype": result["param_dtype"]}), flush=True)

if __name__ == "__main__":
    main()
