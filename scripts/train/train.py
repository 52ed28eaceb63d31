# From the PyTorch distributed cookbook: the cells tagged 'script:train/train.py' in
#   notebooks/09_from_notebook_to_cluster.ipynb
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
"""Train the GPT of model.py under torchrun, at any layout of data, tensor and pipeline parallelism.

    python train.py prepare --text a.txt b.txt --out tokens.bin             # text -> byte tokens (no download)
    torchrun --standalone --nproc-per-node=2 train.py --data tokens.bin     # FSDP2 over 2 ranks (the default)
    torchrun --standalone --nproc-per-node=2 train.py --dp-replicate 2 --dp-shard 1    # DDP
    torchrun --standalone --nproc-per-node=4 train.py --dp-replicate 2 --dp-shard 2    # HSDP 2 x 2
    torchrun --standalone --nproc-per-node=4 train.py --tp 2                # FSDP2 x tensor parallel 2 x 2
    torchrun --standalone --nproc-per-node=2 train.py --pp 2 --accum 4      # pipeline, 4 micro-batches
    python train.py export --ckpt-dir ckpt --out model.pt                   # one file for inference

Without --data it trains on CPython's language reference (shipped with Python), prepared on first use. Defaults fit
the device: a ~86M-parameter model at sequence length 1024 in bf16 with torch.compile on GPUs (NCCL), a tiny one on
CPUs (gloo) that trains for about a minute on two cores. Run it again with the same --ckpt-dir and it resumes from
the newest committed checkpoint, bit for bit at the same layout, and at another layout with the same weights,
optimizer state, schedule and data order (the global batch, --batch, must stay the same).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import resource
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

import checkpoint as ckpt
import data
import parallelize as par
from model import GPT, GPTConfig

GPU_DEFAULTS = {"dim": 768, "n_layers": 12, "n_heads": 12, "seq_len": 1024, "batch_per_dp_rank": 16, "steps": 1000,
                "dtype": "bf16", "compile": True, "lr": 6e-4}
CPU_DEFAULTS = {"dim": 128, "n_layers": 4, "n_heads": 4, "seq_len": 128, "batch_per_dp_rank": 8, "steps": 150,
                "dtype": "fp32", "compile": False, "lr": 3e-3}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


# ---------------------------------------------------------------------------------------------------- process group
def uses_gpu() -> bool:
    """One GPU per local rank, or the CPU for every rank (never a mix)."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def init_distributed() -> torch.device:
    """Join the process group torchrun's environment describes; returns this rank's device. On GPUs: NCCL for CUDA
    tensors bound to this rank's GPU (set_device first: object collectives use the current device; then device_id),
    and gloo beside it for CPU tensors (the stop flag, async checkpoint saves). On CPUs: gloo."""
    if uses_gpu():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


def run_distributed(body, *args, **kwargs):
    """init, body(device, ...), then gc.collect() and destroy_process_group() in a finally. `body` returns plain
    values only, so every object holding collective work is freed before the group goes (else gloo can abort the
    process at exit)."""
    device = init_distributed()
    try:
        return body(device, *args, **kwargs)
    finally:
        gc.collect()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------- flags
class Parser(argparse.ArgumentParser):
    """Bad flags: one line on stderr, exit status 2 (argparse's own error prints the whole usage first)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> Parser:
    p = Parser(prog="train.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="a JSON file of flag values (names as below, with _), overridden by flags")
    g = p.add_argument_group("model (default: GPU-sized on GPUs, tiny on CPUs)")
    g.add_argument("--dim", type=int)
    g.add_argument("--n-layers", type=int)
    g.add_argument("--n-heads", type=int)
    g.add_argument("--mlp-ratio", type=int, default=4)
    g.add_argument("--seq-len", type=int, help="tokens per sequence (also the model's max_seq_len)")
    g = p.add_argument_group("layout: pp x dp_replicate x dp_shard x tp = world size")
    g.add_argument("--dp-replicate", type=int, default=1, help="replicas (DDP; HSDP with --dp-shard > 1)")
    g.add_argument("--dp-shard", type=int, default=-1, help="FSDP2 shards (-1: what the world size leaves)")
    g.add_argument("--tp", type=int, default=1, help="tensor parallel (sequence parallel, loss parallel)")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages (the micro-batches are --accum)")
    g.add_argument("--pp-schedule", choices=["1f1b", "gpipe"], default="1f1b")
    g = p.add_argument_group("training")
    g.add_argument("--data", help="a token file from `train.py prepare` (default: CPython's language reference)")
    g.add_argument("--steps", type=int, help="optimizer steps in all (a resumed run continues to it)")
    g.add_argument("--batch", type=int, help="global batch: sequences per optimizer step over all data-parallel "
                   "ranks (default: 16 per data-parallel rank on GPUs, 8 on CPUs)")
    g.add_argument("--accum", type=int, default=1, help="micro-batches per step (gradient accumulation)")
    g.add_argument("--lr", type=float, help="peak learning rate")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="the cosine decays to lr x this")
    g.add_argument("--warmup", type=int, help="linear warm-up steps (default: 5%% of --steps)")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's, on matrices and embeddings only")
    g.add_argument("--clip", type=float, default=1.0, help="max gradient norm (0: no clipping)")
    g.add_argument("--dtype", choices=sorted(DTYPES), help="bf16: FSDP2's mixed precision when sharded, autocast "
                   "elsewhere (default: bf16 on GPUs, fp32 on CPUs)")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, help="torch.compile each block "
                   "(default: on GPUs)")
    g.add_argument("--ac", choices=["none", "full", "selective", "alternate"], default="none",
                   help="activation checkpointing per block")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("evaluation, logging, checkpoints")
    g.add_argument("--eval-every", type=int, default=0, help="steps between evaluations (0: at the end only)")
    g.add_argument("--eval-windows", type=int, default=64, help="held-out sequences per evaluation")
    g.add_argument("--log-every", type=int, default=10)
    g.add_argument("--metrics", help="append every step's loss, lr and gradient norm (JSON lines) to this file")
    g.add_argument("--ckpt-dir", help="DCP checkpoints here; a run resumes from the newest committed one")
    g.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0: at the end only)")
    g.add_argument("--keep", type=int, default=2, help="committed checkpoints kept")
    g.add_argument("--async-save", action="store_true", help="dcp.async_save: write while training goes on")
    g.add_argument("--export", help="at the end, write the whole model to this file for inference (torch.save; "
                   "with --pp it needs --ckpt-dir and is made from the last checkpoint)")
    g.add_argument("--crash-at", type=int, help="plant a failure: after this step the last rank kills itself "
                   "(--crash-signal), on torchrun's first attempt only")
    g.add_argument("--crash-signal", choices=["KILL", "TERM"], default="KILL")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags over --config over the device's defaults; every layout and size error here, before any process
    group exists (exit status 2, one line)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config:
        try:
            values = json.loads(Path(args.config).read_text())
        except (OSError, ValueError) as e:
            parser.error(f"--config {args.config}: {e}")
        known = {a.dest for a in parser._actions}
        unknown = sorted(set(values) - known)
        if unknown:
            parser.error(f"--config {args.config}: unknown keys {unknown}")
        parser.set_defaults(**values)
        args = parser.parse_args(argv)
    defaults = GPU_DEFAULTS if uses_gpu() else CPU_DEFAULTS
    for key in ("dim", "n_layers", "n_heads", "seq_len", "steps", "dtype", "compile", "lr"):
        if getattr(args, key) is None:
            setattr(args, key, defaults[key])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for key in ("tp", "pp", "dp_replicate", "accum", "steps", "dim", "n_layers", "n_heads", "seq_len", "log_every"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be at least 1, got {getattr(args, key)}")
    if args.dp_shard == -1:
        args.dp_shard = world // (args.dp_replicate * args.tp * args.pp) or 1
    dp = args.dp_replicate * args.dp_shard
    if args.batch is None:
        args.batch = defaults["batch_per_dp_rank"] * dp * (args.accum if args.pp > 1 else 1)
    if args.warmup is None:
        args.warmup = max(1, args.steps // 20)
    try:
        par.check_layout(world, args.dp_replicate, args.dp_shard, args.tp, args.pp, model_config(args), args.seq_len)
    except ValueError as e:
        parser.error(str(e))
    if args.dim % args.n_heads:
        parser.error(f"--n-heads {args.n_heads} must divide --dim {args.dim}")
    if args.batch % (dp * args.accum):
        parser.error(f"--batch {args.batch} must be a multiple of data-parallel ranks {dp} x --accum {args.accum}")
    if args.pp > 1 and args.pp_schedule == "1f1b" and args.accum < args.pp:
        parser.error(f"the 1f1b schedule needs --accum (micro-batches) >= --pp {args.pp}, got {args.accum}")
    if args.export and args.pp > 1 and not args.ckpt_dir:
        parser.error("--export with --pp needs --ckpt-dir: no rank holds the whole model, the checkpoint does")
    if args.data is not None and not Path(args.data).is_file():
        parser.error(f"--data {args.data}: no such file (make one with: python train.py prepare --text ... --out ...)")
    return args


def model_config(args) -> GPTConfig:
    return GPTConfig(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, max_seq_len=args.seq_len,
                     mlp_ratio=args.mlp_ratio)


# ---------------------------------------------------------------------------------------------------------- training
def default_data() -> Path:
    """CPython's language reference as byte tokens, prepared once per user (every rank may do it: the file is
    written under a temporary name and renamed, and every writer writes the same bytes)."""
    path = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gpt-recipe" / "pydoc_topics.u8"
    if not data.meta_path(path).exists():
        data.prepare([data.default_corpus_text()], path)
    return path


class Built:
    """What the flags build on this rank, in order: its place in the named mesh, the model made parallel, the
    pipeline schedule, the optimizer and its schedule, the data loader, and the state a checkpoint holds."""

    def __init__(self, args, device: torch.device):
        self.args, self.device = args, device
        self.world = dist.get_world_size()
        cfg = self.cfg = model_config(args)
        self.mesh = par.build_mesh(self.world, args.dp_replicate, args.dp_shard, args.tp, args.pp, device.type,
                                   cfg, args.seq_len)
        self.dp_rank, self.dp = par.dp_rank_and_size(self.mesh)
        self.tp_rank, self.pp_rank = self.mesh.get_local_rank("tp"), self.mesh.get_local_rank("pp")
        self.last_stage = self.pp_rank == args.pp - 1
        self.dtype = DTYPES[args.dtype]
        self.fsdp = uses_fsdp(args)
        self.ddp = uses_ddp(args)
        self.model, self.train_model = build_model(args, cfg, self.mesh, device, self.dtype)
        self.stage = None
        if args.pp > 1:
            self.stage = par.pipeline_stage(self.train_model, self.mesh["pp"], device)
            self.schedule = par.pipeline_schedule(self.stage, args.pp_schedule, args.accum, cross_entropy)
        # autocast where FSDP2's policy does not already compute in bf16
        self.autocast = self.dtype != torch.float32 and not self.fsdp
        self.optimizer, self.scheduler = build_optimizer(self.model, args)
        self.data_path = Path(args.data) if args.data else default_data()
        self.local_batch = args.batch // self.dp             # per step; a micro-batch is this / accum
        micro = self.local_batch if args.pp > 1 else self.local_batch // args.accum
        self.loader = data.train_loader(self.data_path, args.seq_len, micro, self.dp_rank, self.dp,
                                        args.batch, args.seed)
        self.batches = None        # iter(loader) at the first step: after a checkpoint has set its position
        self.state = ckpt.TrainState(self.train_model, self.optimizer, self.scheduler, self.loader)

    def _next(self):
        if self.batches is None:
            self.batches = iter(self.loader)
        x, y = next(self.batches)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)


def uses_fsdp(args) -> bool:
    """FSDP2 shards the model when the layout has shards, and also replicates it where DDP cannot (beside tensor
    or pipeline parallelism: FSDP2 over the replicas, with one shard each)."""
    return args.dp_shard > 1 or (args.dp_replicate > 1 and (args.tp > 1 or args.pp > 1))


def uses_ddp(args) -> bool:
    """DDP replicates the whole model where the layout has replicas and nothing else."""
    return args.dp_replicate > 1 and not uses_fsdp(args)


def layout_name(args) -> str:
    parts = []
    if args.pp > 1:
        parts.append(f"pipeline {args.pp} ({args.pp_schedule})")
    if args.dp_replicate > 1 and args.dp_shard > 1:
        parts.append(f"HSDP {args.dp_replicate}x{args.dp_shard}")
    elif uses_fsdp(args):
        parts.append(f"FSDP2 {args.dp_replicate * args.dp_shard}")
    elif uses_ddp(args):
        parts.append(f"DDP {args.dp_replicate}")
    if args.tp > 1:
        parts.append(f"TP {args.tp}")
    return " x ".join(parts) or "one process"


def build_model(args, cfg: GPTConfig, mesh, device: torch.device, dtype: torch.dtype):
    """The GPT made parallel by the layout, in parallelize.py's order: built on the meta device, cut into this
    rank's pipeline stage, tensor parallel, activation checkpointing, compiled, sharded by FSDP2; then to_empty and
    init_weights make this rank's pieces real. Returns (the model, the module the step calls: DDP's or the model)."""
    with torch.device("meta"):                    # no memory yet: each rank materializes only its pieces
        model = GPT(cfg)
    if args.pp > 1:
        model = par.pipeline_split(model, mesh["pp"])
    if args.tp > 1:
        par.apply_tp(model, mesh["tp"], loss_parallel=True)
    par.apply_ac(model, args.ac)
    if args.compile:
        par.apply_compile(model)
    if uses_fsdp(args):
        dims = ("dp_replicate", "dp_shard") if args.dp_replicate > 1 else ("dp_shard",)
        par.apply_fsdp(model, mesh[dims], param_dtype=dtype if dtype != torch.float32 else None,
                       reshard_after_forward=args.pp == 1)
    model.to_empty(device=device)
    model.init_weights(args.seed)
    return model, par.apply_ddp(model, mesh["dp_replicate"], device) if uses_ddp(args) else model


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss on float32 logits (a bf16 softmax would lose the loss's low bits)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def lr_lambda(warmup: int, steps: int, min_ratio: float):
    """Linear warm-up to the peak over `warmup` steps, then cosine decay to min_ratio x peak at `steps`."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def build_optimizer(model, args):
    """AdamW, with weight decay on the matrices and embeddings only (not the norms' weights), and its learning-rate
    schedule. Built after FSDP2: its parameters are the sharded DTensors, so its state is sharded too."""
    decay = [p for n, p in model.named_parameters() if not n.endswith("norm.weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    groups = [g for g in ({"params": decay, "weight_decay": args.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.warmup, args.steps, args.min_lr_ratio))
    return optimizer, scheduler


def plain(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (the loss under loss_parallel is one), a tensor as is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class Stepper(Built):
    """`step()`: one optimizer step, collective (every rank calls it)."""

    def _context(self):
        """What the forward and backward run inside: loss_parallel with TP (the logits are split over the
        vocabulary), autocast where asked and FSDP2 does not already cast."""
        stack = contextlib.ExitStack()
        if self.args.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel
            stack.enter_context(loss_parallel())
        if self.autocast:
            stack.enter_context(torch.autocast(self.device.type, dtype=self.dtype))
        return stack

    def _accumulate(self) -> torch.Tensor:
        """--accum micro-batches, forward and backward; DDP all-reduces the gradients after the last one only
        (no_sync before). Returns this rank's mean loss."""
        loss = torch.zeros((), device=self.device)
        for m in range(self.args.accum):
            x, y = self._next()
            sync = m == self.args.accum - 1 or not self.ddp     # DDP: one gradient all-reduce per step
            with self._context(), (contextlib.nullcontext() if sync else self.train_model.no_sync()):
                micro_loss = cross_entropy(self.train_model(x), y) / self.args.accum
                micro_loss.backward()
            loss += plain(micro_loss).detach()
        return loss

    def _through_stages(self, schedule_call, x, y) -> list:
        """A pipeline schedule's step or eval, called as this rank's stage needs: the first stage feeds the inputs,
        the last the targets; returns the last stage's micro-batch losses."""
        losses = []
        with self._context():
            if self.pp_rank == 0:
                schedule_call(x)
            elif self.last_stage:
                schedule_call(target=y, losses=losses)
            else:
                schedule_call()
        return losses

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over --accum micro-batches; returns (this rank's mean loss, or 0 off the last
        pipeline stage; the gradient norm before clipping)."""
        args = self.args
        if self.stage is not None:
            losses = self._through_stages(self.schedule.step, *self._next())
            loss = torch.stack([plain(l).detach() for l in losses]).mean() if losses else \
                torch.zeros((), device=self.device)
        else:
            loss = self._accumulate()
        if args.clip > 0:
            norm = par.clip_grad_norm_(self.model.parameters(), args.clip, self.mesh["pp"] if args.pp > 1 else None)
        else:
            norm = torch.zeros((), device=self.device)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        return loss, norm


class Trainer(Stepper):
    """The model made parallel by the layout, its optimizer, schedule, data and checkpoints; `step()` and
    `evaluate()` are collective (every rank calls them)."""

    def global_mean(self, value: torch.Tensor) -> float:
        """The mean over data-parallel replicas of a value every (tp, last-stage) rank holds alike: one all-reduce
        over the whole world, each replica counted once (tp peers and other stages add zero)."""
        counted = self.last_stage and self.tp_rank == 0
        total = (value.detach().float() if counted else torch.zeros((), device=self.device)) / self.dp
        total = total.reshape(1).clone()
        dist.all_reduce(total)
        return total.item()

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the first --eval-windows held-out sequences (the same ones at every layout)."""
        args = self.args
        self.train_model.eval()
        total = torch.zeros((), device=self.device)
        count = 0
        for x, y in data.eval_batches(self.data_path, args.seq_len, max(1, self.local_batch // args.accum),
                                      self.dp_rank, self.dp, args.eval_windows):
            x, y = x.to(self.device), y.to(self.device)
            if self.stage is not None:
                total += self._pipeline_eval(x, y) * len(x)
            else:
                with self._context():
                    total += plain(cross_entropy(self.train_model(x), y)).detach() * len(x)
            count += len(x)
        self.train_model.train()
        if self.fsdp:
            self.model.reshard()        # a forward without backward leaves the root's weights gathered
        return self.global_mean(total / count)

    def _pipeline_eval(self, x, y) -> torch.Tensor:
        """One held-out batch through the pipeline stages, forward only where the schedule can (eval())."""
        n = self.args.accum
        if len(x) % n:
            n = 1
        schedule = par.pipeline_schedule(self.stage, "gpipe", n, cross_entropy)
        losses = self._through_stages(schedule.eval if hasattr(schedule, "eval") else schedule.step, x, y)
        self.optimizer.zero_grad(set_to_none=True)
        return torch.stack([plain(l) for l in losses]).mean() if losses else torch.zeros((), device=self.device)


# ---------------------------------------------------------------------------------------------------- measurements
def matmul_peak(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of large square matmuls on this device in `dtype`, the best of a few timings (about a second on a
    GPU, a fraction on a CPU): the ceiling MFU is measured against, what this rank can reach here and now (on a
    shared CPU, with its peers running)."""
    sizes = (4096, 8192) if device.type == "cuda" else (512,)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = 0.0
    for n in sizes:
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        reps = max(2, int(4e12 // (2 * n ** 3))) if device.type == "cuda" else 3
        a @ b
        for _ in range(4):
            sync()
            start = time.perf_counter()
            for _ in range(reps):
                a @ b
            sync()
            best = max(best, 2 * n ** 3 * reps / (time.perf_counter() - start))
        del a, b
    return best


def peak_memory_bytes(device: torch.device) -> int:
    """The most memory this rank held: CUDA's allocator peak on a GPU, the process's maximum resident set on a CPU
    (ru_maxrss: KiB on Linux, bytes on macOS)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def log(rank: int, message: str) -> None:
    if rank == 0:
        print(message, flush=True)


def write_metrics(metrics, **values) -> None:
    """One JSON line in the --metrics file (open on rank 0 only: None elsewhere)."""
    if metrics:
        print(json.dumps(values), file=metrics)


class Meter:
    """The log line's figures over the steps since the last line: tokens/s, MFU against the world's matmul peak
    (the sum of the ranks', measured once at the start) and the largest peak memory of any rank."""

    def __init__(self, args, cfg: GPTConfig, device: torch.device, dtype: torch.dtype):
        peak = torch.tensor([matmul_peak(device, dtype)], dtype=torch.float64)
        dist.all_reduce(peak)                                   # the world's ceiling: the sum of the ranks'
        self.args, self.device, self.peak = args, device, peak.item()
        self.flops_per_token = cfg.flops_per_token(args.seq_len)
        self.tokens_per_step = args.batch * args.seq_len
        self.tokens_per_s = self.mfu = self.memory_gib = 0.0
        self.restart()

    def restart(self) -> float:
        """A new window of steps; returns its start (time.perf_counter)."""
        self.start, self.steps = time.perf_counter(), 0
        return self.start

    def report(self, rank: int, step: int, loss: float, lr: float, norm: float) -> None:
        """Rank 0 prints the line for `step`; collective (the peak memory is the world's largest)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - self.start
        self.tokens_per_s = self.steps * self.tokens_per_step / elapsed
        self.mfu = self.tokens_per_s * self.flops_per_token / self.peak
        memory = torch.tensor([peak_memory_bytes(self.device)], dtype=torch.float64)
        dist.all_reduce(memory, op=dist.ReduceOp.MAX)
        self.memory_gib = memory.item() / 2 ** 30
        left = (self.args.steps - step) * elapsed / self.steps
        log(rank, f"step {step:>6}/{self.args.steps}  loss {loss:.4f}  lr {lr:.2e}  grad_norm {norm:.3f}  tokens/s "
                  f"{self.tokens_per_s:,.0f}  MFU {100 * self.mfu:.1f}%  peak memory {self.memory_gib:.2f} GiB  "
                  f"time left {left:.0f} s")
        self.restart()

    def figures(self) -> dict:
        return {"tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "matmul_peak_tflops": self.peak / 1e12,
                "peak_memory_gib": self.memory_gib}


def resume(trainer: Trainer, args):
    """(the Checkpointer of --ckpt-dir or None, the checkpoint resumed from or None). `load_latest` puts the newest
    committed checkpoint's weights, optimizer state, schedule and data position into the trainer's state, whatever
    layout wrote it; the config saved beside each checkpoint lets `train.py export` rebuild the model."""
    if not args.ckpt_dir:
        return None, None
    config = {"model": vars(trainer.cfg), "args": {k: v for k, v in vars(args).items()}}
    checkpointer = ckpt.Checkpointer(args.ckpt_dir, args.keep, args.async_save, config)
    return checkpointer, checkpointer.load_latest(trainer.state)


def save_and_export(trainer: Trainer, checkpointer, args, rank: int, stopped: bool) -> None:
    """The last step's checkpoint (unless saved already), waited for (an async save may still be writing); then
    --export: gathered from the live model, or with a pipeline (no rank holds it whole) from that checkpoint."""
    if checkpointer:
        if checkpointer.saved_step != trainer.state.step:
            checkpointer.save(trainer.state)
        checkpointer.wait()
    if args.export and not stopped:
        if args.pp > 1:
            dist.barrier()                  # rank 0 committed the last save before the barrier
            if rank == 0:
                ckpt.export(ckpt.latest(args.ckpt_dir), args.export)
        else:
            ckpt.export_full_state_dict(trainer.train_model, trainer.cfg, args.export)
        log(rank, f"exported the model to {args.export}")


class StopFlag:
    """SIGTERM (torchrun forwards it to every worker when it is stopped; SLURM sends it before the end of a job):
    finish the step, save, exit cleanly. The ranks agree on stopping through one small all-reduce per step."""

    def __init__(self):
        self.signal = 0
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.signal = signum

    def agreed(self) -> bool:
        flag = torch.tensor([self.signal], dtype=torch.int32)          # a CPU tensor: the gloo group carries it
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def plant_crash(args, step: int, rank: int, world: int) -> None:
    """--crash-at: after that step the last rank sends itself --crash-signal, on torchrun's first attempt only."""
    if args.crash_at == step and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0 and rank == world - 1:
        os.kill(os.getpid(), getattr(signal, f"SIG{args.crash_signal}"))
        time.sleep(0.1)                                  # let the handler run before the next check


def train(device: torch.device, args) -> dict:
    """Build, resume if a checkpoint exists, train to --steps, evaluate, save; returns plain values only."""
    rank, world = dist.get_rank(), dist.get_world_size()
    stop = StopFlag()
    trainer = Trainer(args, device)
    cfg = trainer.cfg
    checkpointer, resumed = resume(trainer, args)
    meter = Meter(args, cfg, device, trainer.dtype)
    log(rank, f"training a {cfg.num_params() / 1e6:.2f}M-parameter GPT ({cfg.n_layers} layers, dim {cfg.dim}) on "
              f"{world} {device.type} rank{'s' * (world > 1)} as {layout_name(args)}, {args.dtype}"
              f"{', compiled' if args.compile else ''}: steps {trainer.state.step + 1} to {args.steps} of "
              f"{args.batch} x {args.seq_len} tokens"
              f"{f', resumed from {resumed}' if resumed else ''}; matmul peak here {meter.peak / 1e12:.3g} "
              f"TFLOP/s in all; a line every {args.log_every} steps with the time left")
    metrics = open(args.metrics, "a", buffering=1) if args.metrics and rank == 0 else None
    first_step, eval_loss, stopped = trainer.state.step, None, False
    started = meter.restart()
    try:
        while trainer.state.step < args.steps:
            loss, norm = trainer.step()
            step = trainer.state.step
            meter.steps += 1
            logged = step % args.log_every == 0 or step == args.steps or step == first_step + 1
            if args.metrics or logged:                         # collective: every rank takes part
                mean_loss, norm_value = trainer.global_mean(loss), norm.item()
                lr = trainer.scheduler.get_last_lr()[0]
                write_metrics(metrics, step=step, loss=mean_loss, lr=lr, grad_norm=norm_value)
            if logged:
                meter.report(rank, step, mean_loss, lr, norm_value)
            if args.eval_every and step % args.eval_every == 0 and step < args.steps:
                eval_loss = trainer.evaluate()
                log(rank, f"step {step:>6}  eval loss {eval_loss:.4f}")
                write_metrics(metrics, step=step, eval_loss=eval_loss)
            if checkpointer and args.save_every and step % args.save_every == 0 and step < args.steps:
                checkpointer.save(trainer.state)
            elif checkpointer:
                checkpointer.poll()                            # an async save written since: committed now
            plant_crash(args, step, rank, world)
            if stop.agreed():
                log(rank, f"step {step:>6}  stopping on signal {stop.signal or 'from a peer'}: saving and exiting")
                stopped = True
                break
        if not stopped:
            eval_loss = trainer.evaluate()
            log(rank, f"step {trainer.state.step:>6}  eval loss {eval_loss:.4f}")
            write_metrics(metrics, step=trainer.state.step, eval_loss=eval_loss, final=True)
        save_and_export(trainer, checkpointer, args, rank, stopped)
    finally:
        if metrics:
            metrics.close()
    dist.barrier()
    return {"rank": rank, "step": trainer.state.step, "eval_loss": eval_loss, "stopped": stopped,
            "seconds": time.perf_counter() - started, **meter.figures(), "parameters": cfg.num_params(),
            "world_size": world, "device": device.type,
            "checkpoint": str(ckpt.latest(args.ckpt_dir)) if args.ckpt_dir else None}


def export_main(argv: list[str]) -> None:
    parser = Parser(prog="train.py export", description="One torch.save file of the whole model from a committed "
                    "checkpoint (any layout), for inference.")
    parser.add_argument("--ckpt-dir", required=True, help="a --ckpt-dir of a training run, or one step_N in it")
    parser.add_argument("--out", required=True, help="the file to write")
    args = parser.parse_args(argv)
    path = Path(args.ckpt_dir)
    source = path if (path / ".metadata").exists() else ckpt.latest(path)
    if source is None:
        parser.error(f"no committed checkpoint in {path}")
    ckpt.export(source, args.out)
    print(f"exported {source} to {args.out}", flush=True)


@record   # a failing rank's traceback goes into torchrun's error file, and its summary names the root cause
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["prepare"]:
        return data.main(argv[1:])
    if argv[:1] == ["export"]:
        return export_main(argv[1:])
    args = parse_args(argv)
    result = run_distributed(train, args)
    if result["rank"] == 0:
        print("summary: " + json.dumps({k: v for k, v in result.items() if k != "rank"}), flush=True)

if __name__ == "__main__":
    main()
