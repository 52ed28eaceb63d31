# Written by `./cookbook export` from notebooks/05_mixed_precision.ipynb, cells tagged 'script:train_amp.py'.
# Edit those cells, not this file. Run: torchrun --standalone --nproc-per-node=2 train_amp.py --help
"""AMP training with torch.amp: bf16 autocast, or fp16 autocast with a GradScaler, optionally torch.compile'd,
data-parallel over the ranks with DDP. The loss is computed on float32 logits. Defaults fit the device: a ~100M
GPT on GPUs, a small one that trains in under a minute on two CPU cores; rank 0 logs every --log-every steps.

    torchrun --standalone --nproc-per-node=2 train_amp.py --dtype bf16 --steps 50

For a project: scripts/train/ adds meta-device init, FSDP2's bf16 policy, warm-up and cosine decay, evaluation,
checkpoints and resume, and MFU logging: `torchrun --standalone --nproc-per-node=2 scripts/train/train.py`.
"""
import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# main()'s defaults per device: a compute-bound ~100M GPT on a GPU; under a minute of 200 steps on two CPU cores
MAIN_DEFAULTS = {"cuda": dict(batch=32, seq_len=256, d_model=1024, layers=8, heads=16, lr=3e-4),
                 "cpu": dict(batch=8, seq_len=64, d_model=128, layers=2, heads=4, lr=1e-3)}


def init_distributed():
    """torchrun's process group: NCCL on this rank's own GPU (device_id) where every local rank has one, else gloo."""
    use_gpu = torch.cuda.is_available() and int(os.environ["LOCAL_WORLD_SIZE"]) <= torch.cuda.device_count()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if use_gpu else torch.device("cpu")
    if use_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_gpu else "gloo", device_id=device if use_gpu else None)
    return device


def char_corpus():
    """CPython's language reference (pydoc_data, standard library) as character ids, and the vocabulary size."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text]), len(chars)


def get_batch(tokens, batch, seq_len, g):
    """`batch` random windows of `seq_len` characters and the characters that follow them, drawn from `g`."""
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch, 1), generator=g)
    index = starts + torch.arange(seq_len)
    return tokens[index], tokens[index + 1]


class Block(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads, self.checkpointed = n_heads, False  # checkpointed: see checkpoint_blocks
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        if self.checkpointed and torch.is_grad_enabled():  # keep only x; run the block again in backward
            return checkpoint(self.attend_and_mix, x, use_reentrant=False)
        return self.attend_and_mix(x)

    def attend_and_mix(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, d_model, n_layers, n_heads, seq_len):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d_model), nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # logits, in the autocast dtype inside an autocast region


def checkpoint_blocks(model):
    """Activation checkpointing in every block. A flag the block's forward reads, not a wrapper module: the
    parameters keep their names (`blocks.i.qkv.weight`), so a checkpoint saved with it loads without it."""
    for block in model.blocks:
        block.checkpointed = True
    return model


def loss_of(model, x, y, dtype=torch.float32):
    """Forward with matmuls in `dtype` under autocast; cross-entropy on float32 logits, never in bf16/fp16."""
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32):
        logits = model(x)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def train_step(model, opt, scaler, x, y, dtype, max_norm=1.0):
    """One step. A GradScaler that is not enabled (all but fp16) passes the loss and the step through unchanged."""
    loss = loss_of(model, x, y, dtype)
    scaler.scale(loss).backward()  # fp16: gradients `scale` times too large, so small ones do not underflow
    scaler.unscale_(opt)           # back to their true size (fp32), so that clipping sees the real norm
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(opt)               # skips the step if any gradient is inf or nan
    scaler.update()                # halves the scale after a skip, doubles it after growth_interval clean steps
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def train(args, device):
    """Build, train, and return plain numbers only: every object that holds process-group work is freed on return."""
    rank = dist.get_rank()
    tokens, vocab = char_corpus()
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = GPT(vocab, args.d_model, args.layers, args.heads, args.seq_len).to(device)
    if args.checkpoint:
        checkpoint_blocks(model)
    parameters = sum(p.numel() for p in model.parameters())
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if args.compile:
        model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=device.type == "cuda")
    dtype = DTYPES[args.dtype]
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches
    if rank == 0:
        print(f"{parameters:,} parameters, {args.steps} steps of {args.batch} x {args.seq_len} tokens per rank on "
              f"{dist.get_world_size()} {device.type} ranks", flush=True)
    losses, start = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = (t.to(device) for t in get_batch(tokens, args.batch, args.seq_len, g))
        losses.append(train_step(model, opt, scaler, x, y, dtype).item())
        if rank == 0 and args.log_every and (step % args.log_every == 0 or step in (1, args.steps)):
            took = time.perf_counter() - start
            print(f"step {step:>5}/{args.steps}  loss {losses[-1]:.4f}  {took:.1f} s, about "
                  f"{took / step * (args.steps - step):.0f} s left", flush=True)
    return {"parameters": parameters, "first": losses[0], "last": sum(losses[-5:]) / len(losses[-5:]),
            "seconds": time.perf_counter() - start, "scale": scaler.get_scale() if scaler.is_enabled() else None}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="autocast dtype (fp32: none)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the DDP model")
    parser.add_argument("--tf32", action="store_true", help="fp32 matmuls and convolutions in TF32 (Ampere or later)")
    parser.add_argument("--checkpoint", action="store_true", help="activation checkpointing in every block")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=20, help="rank 0 prints step, loss, time (0: never)")
    sizes = parser.add_argument_group("sizes (default: the first value on GPUs, the second on CPUs)")
    sizes.add_argument("--batch", type=int, help="sequences per rank and step (32; 8)")
    sizes.add_argument("--seq-len", type=int, help="(256; 64)")
    sizes.add_argument("--d-model", type=int, help="(1024; 128)")
    sizes.add_argument("--layers", type=int, help="(8; 2)")
    sizes.add_argument("--heads", type=int, help="(16; 4)")
    sizes.add_argument("--lr", type=float, help="(3e-4; 1e-3)")
    args = parser.parse_args()
    # TF32: fp32 matmuls and convolutions on tensor cores, with 10 mantissa bits; "ieee" keeps true fp32
    torch.backends.cuda.matmul.fp32_precision = "tf32" if args.tf32 else "ieee"
    torch.backends.cudnn.conv.fp32_precision = "tf32" if args.tf32 else "ieee"
    device = init_distributed()
    for name, value in MAIN_DEFAULTS[device.type].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    try:
        r = train(args, device)
        if dist.get_rank() == 0:
            scale = f", final scale {r['scale']:g}" if r["scale"] else ""
            print(f"summary: {args.dtype}{' + compile' if args.compile else ''} on {dist.get_world_size()} "
                  f"{device.type} ranks, {r['parameters']:,} parameters, loss {r['first']:.3f} -> {r['last']:.3f} "
                  f"in {args.steps} steps, {r['seconds']:.1f} s{scale}", flush=True)
    finally:
        gc.collect()
        dist.destroy_process_group()

if __name__ == "__main__":
    main()
