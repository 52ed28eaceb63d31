# Written by `./cookbook export` from notebooks/07_tensor_parallel_and_2d.ipynb, cells tagged 'script:train_tp.py'.
# Edit those cells, not this file. Run: torchrun --standalone --nproc-per-node=2 train_tp.py --help
"""A small GPT trained with tensor parallelism (Megatron-style, sequence parallel, loss parallel) and FSDP2 on a
2-D ("dp", "tp") DeviceMesh, on CPython's language reference read character by character.

    torchrun --standalone --nproc-per-node=2 train_tp.py              # TP over 2 ranks
    torchrun --standalone --nproc-per-node=4 train_tp.py --tp 2       # FSDP over 2 x TP over 2
"""
import argparse
import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, loss_parallel, parallelize_module)


@dataclass
class Config:
    vocab_size: int
    seq_len: int = 64
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(cfg.d_model, cfg.d_model, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        # -1 heads: all of them in one process, this rank's share under tensor parallelism
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w1, self.w2 = nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(cfg.d_model), Attention(cfg)
        self.norm2, self.mlp = nn.LayerNorm(cfg.d_model), MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Embed(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tok, self.pos = nn.Embedding(cfg.vocab_size, cfg.d_model), nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, idx):
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed = Embed(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def corpus(pad_vocab_to=64):
    """CPython's language reference as character ids (standard library: nothing to download), and the vocabulary
    size rounded up to a multiple of `pad_vocab_to` so the output layer splits evenly (nanoGPT pads GPT-2's too)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    tokens = torch.tensor([index[c] for c in text], dtype=torch.long)
    return tokens, -(-len(chars) // pad_vocab_to) * pad_vocab_to


def text_batch(tokens, batch, seq_len, generator):
    """Random windows of the corpus and their next characters."""
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch,), generator=generator).tolist()
    x = torch.stack([tokens[s:s + seq_len] for s in starts])
    return x, torch.stack([tokens[s + 1:s + seq_len + 1] for s in starts])


def setup():
    """init_process_group from torchrun's environment: NCCL with this rank's own GPU (device_id) when every local
    rank can have one, else gloo on the CPU. Returns the device."""
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def apply_tp(model, tp_mesh, sequence_parallel=True):
    """Megatron-style TP inside each block, loss-parallel output layer; with `sequence_parallel` the norms and the
    residual stream are sharded along the sequence (Shard(1)). The embeddings stay replicated over tp."""
    seq = Shard(1)
    for block in model.blocks:
        plan = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
                "attn.wo": RowwiseParallel(output_layouts=seq if sequence_parallel else Replicate()),
                "mlp.w1": ColwiseParallel(),
                "mlp.w2": RowwiseParallel(output_layouts=seq if sequence_parallel else Replicate())}
        # The input as one DTensor per attention and MLP (all-gathered from the sequence shards with SP): wq, wk
        # and wv then add their partial input gradients before a single reduction, as Megatron's fused qkv does.
        gather = PrepareModuleInput(input_layouts=(seq if sequence_parallel else Replicate(),),
                                    desired_input_layouts=(Replicate(),))
        plan.update({"attn": gather, "mlp": gather})
        if sequence_parallel:
            plan.update({"norm1": SequenceParallel(), "norm2": SequenceParallel()})
        parallelize_module(block, tp_mesh, plan)
    top = {"head": ColwiseParallel(input_layouts=seq if sequence_parallel else Replicate(),
                                   output_layouts=Shard(-1), use_local_output=False)}  # logits stay sharded
    if sequence_parallel:
        top.update({"embed": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=seq),
                    "norm": SequenceParallel()})
    return parallelize_module(model, tp_mesh, top)


def apply_fsdp(model, dp_mesh):
    """FSDP2 over the dp dimension: each block, then the root (notebook 03's apply_fsdp)."""
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    return fully_shard(model, mesh=dp_mesh)


def parallel_loss(logits, targets):
    """Cross-entropy on logits sharded over the vocabulary: backward too must run inside loss_parallel()."""
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
    return loss


def train(device, steps, tp, batch, lr, d_model, layers, checkpoint_dir=None, seed=0):
    """Train on a (dp, tp) mesh; return plain values only, so every object that holds process-group work is
    freed when this returns (before destroy_process_group)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    tokens, vocab = corpus()
    cfg = Config(vocab_size=vocab, d_model=d_model, n_layers=layers)
    torch.manual_seed(seed)                                   # same weights on every rank
    model = apply_fsdp(apply_tp(GPT(cfg).to(device), mesh["tp"]), mesh["dp"])
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(1000 + mesh.get_local_rank("dp"))   # tp peers share a batch
    losses = []
    for step in range(steps):
        x, y = (t.to(device) for t in text_batch(tokens, batch, cfg.seq_len, gen))
        loss = parallel_loss(model(x), y)
        opt.step()
        opt.zero_grad()
        mean = loss.full_tensor().detach().clone()
        dist.all_reduce(mean, group=mesh.get_group("dp"))
        losses.append(mean.item() / mesh.size(0))
        if rank == 0 and (step % max(1, steps // 10) == 0 or step == steps - 1):
            print(f"step {step:>5}  loss {losses[-1]:.4f}", flush=True)
    if checkpoint_dir:
        dcp.save(get_model_state_dict(model), checkpoint_id=checkpoint_dir)
    return {"rank": rank, "mesh": tuple(mesh.shape), "first": losses[0], "last": losses[-1]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree; dp = world size // tp")
    parser.add_argument("--batch", type=int, default=8, help="sequences per dp rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--checkpoint-dir", default=None, help="save a DCP checkpoint there at the end")
    args = parser.parse_args()
    device = setup()
    try:
        result = train(device, args.steps, args.tp, args.batch, args.lr, args.d_model, args.layers,
                       args.checkpoint_dir)
        gc.collect()
        if result["rank"] == 0:
            print(f"summary: mesh (dp, tp) = {result['mesh']} on {device.type}, loss {result['first']:.3f} -> "
                  f"{result['last']:.3f} in {args.steps} steps", flush=True)
    finally:
        dist.destroy_process_group()

if __name__ == "__main__":
    main()
