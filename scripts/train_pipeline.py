# Written by `./cookbook export` from notebooks/08_pipeline_parallel.ipynb, cells tagged 'script:train_pipeline.py'.
# Edit those cells, not this file. Run: torchrun --standalone --nproc-per-node=2 train_pipeline.py --help
"""A small GPT trained with pipeline parallelism (torch.distributed.pipelining: GPipe, 1F1B or interleaved 1F1B) on
CPython's language reference read character by character. Rank 0 logs every --log-every steps.

    torchrun --standalone --nproc-per-node=2 train_pipeline.py --schedule 1f1b

For a project: scripts/train/ adds meta-device init, stages combined with FSDP2 or TP, clipping across stages, a
schedule, evaluation, checkpoints: `torchrun --standalone --nproc-per-node=2 scripts/train/train.py --pp 2 --accum 4`.
"""
import argparse
import gc
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


@dataclass
class Config:
    vocab_size: int
    seq_len: int = 64
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4


class GPT(nn.Module):
    """Token and position embeddings, pre-norm transformer blocks with a causal mask, final norm, output layer.
    A stage sets the parts it does not own to None and deletes the blocks it does not own."""

    def __init__(self, cfg):
        super().__init__()
        self.tok, self.pos = nn.Embedding(cfg.vocab_size, cfg.d_model), nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleDict({str(i): nn.TransformerEncoderLayer(
            cfg.d_model, cfg.n_heads, 4 * cfg.d_model, dropout=0.0, activation="gelu", batch_first=True,
            norm_first=True) for i in range(cfg.n_layers)})
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x):
        if self.tok is not None:                               # first stage: token ids in
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        for block in self.blocks.values():
            x = block(x, src_mask=mask, is_causal=True)
        if self.head is not None:                              # last stage: logits out
            x = self.head(self.norm(x))
        return x


def stage_module(model, stage, n_stages):
    """Keep only stage `stage` of `n_stages` (equal numbers of blocks); parameter names stay the whole model's."""
    if len(model.blocks) % n_stages:  # else some blocks would silently belong to no stage
        raise ValueError(f"{len(model.blocks)} blocks do not split into {n_stages} equal stages (--layers: a multiple of them)")
    per = len(model.blocks) // n_stages
    mine = {str(i) for i in range(stage * per, (stage + 1) * per)}
    for name in list(model.blocks):
        if name not in mine:
            del model.blocks[name]
    if stage != 0:
        model.tok = model.pos = None
    if stage != n_stages - 1:
        model.norm = model.head = None
    return model


def loss_fn(logits, targets):
    """Mean cross-entropy of one micro-batch (the schedule averages the gradients over micro-batches)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def corpus():
    """CPython's language reference as character ids (standard library: nothing to download), and the vocabulary
    size rounded up to a multiple of 64."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text], dtype=torch.long), -(-len(chars) // 64) * 64


def text_batch(tokens, batch, seq_len, generator):
    """Random windows of the corpus and their next characters."""
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch,), generator=generator).tolist()
    x = torch.stack([tokens[s:s + seq_len] for s in starts])
    return x, torch.stack([tokens[s + 1:s + seq_len + 1] for s in starts])


def init_distributed():
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


def run_distributed(body, *args, **kwargs):
    """The worker: process group, `body(device, *args, **kwargs)`, clean exit. `body` returns plain values only, so
    what it made (stages, schedules, their pending work) is freed before the group goes."""
    device = init_distributed()
    try:
        return body(device, *args, **kwargs)
    finally:
        gc.collect()
        dist.destroy_process_group()


def build_pipeline(cfg, schedule, microbatches, device, seed=0):
    """This rank's stages (one, or two for the interleaved schedule: stages r and r + world) and the schedule.
    Every rank builds the whole model from one seed, so the stages together are exactly that model."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = 2 if schedule == "interleaved" else 1
    n_stages = world * per_rank
    stages = []
    for s in range(rank, n_stages, world):
        torch.manual_seed(seed)
        stages.append(PipelineStage(stage_module(GPT(cfg), s, n_stages).to(device), s, n_stages, device))
    cls = SCHEDULES[schedule]
    return stages, cls(stages if per_rank > 1 else stages[0], n_microbatches=microbatches, loss_fn=loss_fn)


def pipeline_step(schedule, x, y):
    """One step: the first rank feeds the batch, the last rank the targets; the schedule cuts both into
    micro-batches. Returns the micro-batches' losses on the last rank, [] elsewhere."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    if rank == 0:
        schedule.step(x)
    elif rank == world - 1:
        schedule.step(target=y, losses=losses)
    else:
        schedule.step()
    return losses


def train(device, steps, schedule_name, microbatches, mb_size, lr, d_model, layers, seed=0, log_every=None):
    """Train this rank's stages; return plain values only, so every object that holds process-group work is
    freed when this returns (before destroy_process_group). Rank 0 prints step, loss, elapsed and remaining
    seconds every `log_every` steps (default: a tenth of them; 0: never)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, vocab = corpus()
    cfg = Config(vocab_size=vocab, d_model=d_model, n_layers=layers)
    stages, schedule = build_pipeline(cfg, schedule_name, microbatches, device, seed)
    opt = torch.optim.Adam([p for st in stages for p in st.submod.parameters()], lr=lr)
    gen = torch.Generator().manual_seed(1000)            # the first and last ranks need the same windows
    losses, start = [], time.perf_counter()
    log_every = max(1, steps // 10) if log_every is None else log_every
    for step in range(steps):
        x, y = (t.to(device) for t in text_batch(tokens, microbatches * mb_size, cfg.seq_len, gen))
        opt.zero_grad()
        mb_losses = pipeline_step(schedule, x, y)
        opt.step()
        loss = torch.stack(mb_losses).mean().detach() if mb_losses else torch.zeros((), device=device)
        dist.broadcast(loss, src=world - 1)              # the last rank has the loss; everyone learns it
        losses.append(loss.item())
        if rank == 0 and log_every and ((step + 1) % log_every == 0 or step + 1 in (1, steps)):
            took = time.perf_counter() - start
            print(f"step {step + 1:>5}/{steps}  loss {losses[-1]:.4f}  {took:.1f} s, about "
                  f"{took / (step + 1) * (steps - step - 1):.0f} s left", flush=True)
    return {"rank": rank, "stages": world * (2 if schedule_name == "interleaved" else 1), "device": device.type,
            "first": losses[0], "last": losses[-1]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--mb-size", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4, help="divisible by the number of stages")
    parser.add_argument("--log-every", type=int, default=25, help="rank 0 prints step, loss, time (0: never)")
    args = parser.parse_args()
    result = run_distributed(train, args.steps, args.schedule, args.microbatches, args.mb_size, args.lr, args.d_model,
                             args.layers, log_every=args.log_every)
    if result["rank"] == 0:
        print(f"summary: {args.schedule} over {result['stages']} stages on {result['device']}, loss "
              f"{result['first']:.3f} -> {result['last']:.3f} in {args.steps} steps", flush=True)

if __name__ == "__main__":
    main()
