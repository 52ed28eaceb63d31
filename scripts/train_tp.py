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


class Attention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        # -1 heads: all of them in one process, this rank's share under tensor parallelism
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.w1, self.w2 = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(d_model), Attention(d_model, n_heads)
        self.norm2, self.mlp = nn.LayerNorm(d_model), MLP(d_model)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Embed(nn.Module):
    def __init__(self, vocab, d_model, seq_len):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d_model), nn.Embedding(seq_len, d_model)

    def forward(self, idx):
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class GPT(nn.Module):
    def __init__(self, vocab, d_model=256, n_layers=4, n_heads=4, seq_len=64):
        super().__init__()
        self.embed = Embed(vocab, d_model, seq_len)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

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
    return torch.tensor([index[c] for c in text]), -(-len(chars) // pad_vocab_to) * pad_vocab_to


def text_batch(tokens, batch, seq_len, generator):
    """Random windows of the corpus and their next characters."""
    index = torch.randint(0, len(tokens) - seq_len - 1, (batch, 1), generator=generator) + torch.arange(seq_len)
    return tokens[index], tokens[index + 1]


def init_distributed():
    """torchrun's process group: NCCL on this rank's own GPU (device_id) where every local rank has one, else gloo."""
    use_gpu = torch.cuda.is_available() and int(os.environ["LOCAL_WORLD_SIZE"]) <= torch.cuda.device_count()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if use_gpu else torch.device("cpu")
    if use_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_gpu else "gloo", device_id=device if use_gpu else None)
    return device


def run_distributed(body, *args):
    """The worker: process group, `body(device, *args)`, clean exit. `body` returns plain values only, so what it
    made (models, optimizers, their pending collective work) is freed before the group goes: else gloo can abort."""
    device = init_distributed()
    try:
        return body(device, *args)
    finally:
        gc.collect()
        dist.destroy_process_group()


def apply_tp(model, tp_mesh, sequence_parallel=True):
    """Megatron-style TP inside each block, loss-parallel output layer; with `sequence_parallel` the norms and the
    residual stream are sharded along the sequence (Shard(1)). The embeddings stay replicated over tp."""
    between = Shard(1) if sequence_parallel else Replicate()  # the residual stream between the TP layers
    for block in model.blocks:
        # The input as one DTensor per attention and MLP (all-gathered from the sequence shards with SP): wq, wk
        # and wv then add their partial input gradients before a single reduction, as Megatron's fused qkv does.
        gather = PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),))
        plan = {"attn": gather, "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
                "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel(output_layouts=between),
                "mlp": gather, "mlp.w1": ColwiseParallel(), "mlp.w2": RowwiseParallel(output_layouts=between)}
        if sequence_parallel:
            plan |= {"norm1": SequenceParallel(), "norm2": SequenceParallel()}
        parallelize_module(block, tp_mesh, plan)
    top = {"head": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False)}
    if sequence_parallel:  # the embeddings' sum is cut into sequence shards (free), the final norm works on them
        top |= {"embed": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=between),
                "norm": SequenceParallel()}
    return parallelize_module(model, tp_mesh, top)  # logits stay sharded over the vocabulary: loss_parallel


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


def train_step(model, opt, x, y, dp_group):
    """One step on this rank's batch, gradients cleared first (the last ones stay to inspect); the dp-mean loss."""
    opt.zero_grad()
    loss = parallel_loss(model(x), y)
    opt.step()
    mean = loss.full_tensor().detach().clone()
    dist.all_reduce(mean, group=dp_group)
    return mean.item() / dist.get_world_size(dp_group)


def train(device, args):
    """Train on a (dp, tp) mesh; return plain values only (see run_distributed)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    tokens, vocab = corpus()
    torch.manual_seed(0)                                      # same weights on every rank
    model = GPT(vocab, args.d_model, args.layers, args.heads, args.seq_len).to(device)
    model = apply_fsdp(apply_tp(model, mesh["tp"]), mesh["dp"])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1000 + mesh.get_local_rank("dp"))   # tp peers share a batch
    losses = []
    for step in range(args.steps):
        x, y = (t.to(device) for t in text_batch(tokens, args.batch, args.seq_len, gen))
        losses.append(train_step(model, opt, x, y, mesh.get_group("dp")))
        if rank == 0 and (step % max(1, args.steps // 10) == 0 or step == args.steps - 1):
            print(f"step {step:>5}  loss {losses[-1]:.4f}", flush=True)
    if args.checkpoint_dir:
        dcp.save(get_model_state_dict(model), checkpoint_id=args.checkpoint_dir)
    return {"rank": rank, "device": device.type, "mesh": tuple(mesh.shape), "first": losses[0], "last": losses[-1]}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree; dp = world size // tp")
    parser.add_argument("--batch", type=int, default=8, help="sequences per dp rank")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8, help="attention heads: TP gives each rank whole heads")
    parser.add_argument("--checkpoint-dir", default=None, help="save a DCP checkpoint there at the end")
    args = parser.parse_args(argv)
    if args.heads % args.tp or args.d_model % args.heads:
        parser.error(f"--heads {args.heads} must be a multiple of --tp {args.tp} and divide --d-model {args.d_model}")
    return args


def main():
    args = parse_args()
    result = run_distributed(train, args)
    if result["rank"] == 0:
        print(f"summary: mesh (dp, tp) = {result['mesh']} on {result['device']}, loss {result['first']:.3f} -> "
              f"{result['last']:.3f} in {args.steps} steps", flush=True)

if __name__ == "__main__":
    main()
