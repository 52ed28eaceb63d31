# From the PyTorch distributed cookbook: the cells tagged 'script:train/train.py' in
#   notebooks/09_from_notebook_to_cluster.ipynb
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
"""Train the Llama of model.py under torchrun, at any layout of data, tensor and pipeline parallelism.

    python train.py prepare --text a.txt --out tokens.bin --train-tokenizer 8192   # a BPE tokenizer and its tokens
    torchrun --standalone --nproc-per-node=2 train.py --data tokens.bin     # FSDP2 over 2 ranks (the default)
    torchrun --standalone --nproc-per-node=2 train.py --dp-replicate 2 --dp-shard 1    # DDP
    torchrun --standalone --nproc-per-node=4 train.py --dp-replicate 2 --dp-shard 2    # HSDP 2 x 2
    torchrun --standalone --nproc-per-node=4 train.py --tp 2                # FSDP2 x tensor parallel 2 x 2
    torchrun --standalone --nproc-per-node=2 train.py --pp 2 --accum 4      # pipeline, 4 micro-batches
    torchrun --standalone --nproc-per-node=8 train.py --init-from Llama-3.2-1B --data tokens.bin   # fine-tune
    python train.py export --ckpt-dir ckpt --format hf --out my-llama       # a Hugging Face folder
    python generate.py --model my-llama --prompt "Once upon a time"         # look at what was trained
    python selftest.py            # after every edit: the layouts agree, a killed run resumes exactly (CPU, gloo)

Without --data it trains on CPython's language reference (shipped with Python) as bytes, prepared on first use.
Defaults fit the device: the preset 'small' (a Llama of dim 768, 12 layers, sequence length 1024) in bf16 with
torch.compile on GPUs (NCCL), 'tiny' on CPUs (gloo), which trains for about a minute on two cores. Run it again with
the same --ckpt-dir and it resumes from the newest committed checkpoint, bit for bit at the same layout, and at
another layout with the same weights, optimizer state, schedule and data order (the global batch, --batch, must
stay the same).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import resource
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

import checkpoint as ckpt
import data
import hardware
import parallelize as par
from ac import apply_ac, apply_compile
from config import PRESETS, LlamaArgs, Layout, preset
from distributed import run_distributed, uses_gpu
from model import Llama, cross_entropy
from cp import apply_cp, cp_shard
from moe import MoE, apply_ep, apply_moe, moe_aux_loss

from pipeline import SCHEDULE_STAGES, StagesView, pipeline_schedule, pipeline_split, pipeline_stage
from tp import apply_tp

GPU_DEFAULTS = {"model": "small", "batch_per_dp_rank": 16, "steps": 1000, "dtype": "bf16", "compile": True,
                "lr": 6e-4}
CPU_DEFAULTS = {"model": "tiny", "batch_per_dp_rank": 8, "steps": 150, "dtype": "fp32", "compile": False, "lr": 3e-3}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SHAPE_FLAGS = ("dim", "n_layers", "n_heads", "n_kv_heads", "tie_embeddings")   # a preset's fields a flag changes
SNAPSHOT_STEPS = 3         # --memory-snapshot records through this many steps: where the peak is reached
VOCAB_MULTIPLE = 64        # a vocabulary from the token file is rounded up to this (any --tp up to 64 divides it)


# ---------------------------------------------------------------------------------------------------------- flags
class Parser(argparse.ArgumentParser):
    """Bad flags: one line on stderr, exit status 2 (argparse's own error prints the whole usage first)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (default: the preset 'small' on GPUs, 'tiny' on CPUs)")
    g.add_argument("--model", choices=sorted(PRESETS), help="a named shape (config.py's PRESETS); the flags below "
                   "change it")
    g.add_argument("--init-from", help="a Hugging Face Llama folder (config.json, *.safetensors): its shape, and "
                   "its weights before the first step (a checkpoint in --ckpt-dir wins: that is a resume)")
    g.add_argument("--dim", type=int)
    g.add_argument("--n-layers", type=int)
    g.add_argument("--n-heads", type=int)
    g.add_argument("--n-kv-heads", type=int, help="key/value heads (grouped-query attention; default: the preset's)")
    g.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, help="the output layer is the "
                   "embedding (default: the preset's, untied)")
    g.add_argument("--vocab-size", type=int, help="default: the token file's, rounded up to a multiple of "
                   f"{VOCAB_MULTIPLE}")
    g.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's max_seq_len, which it "
                   "sets unless --init-from gives one)")


def build_parser() -> Parser:
    p = Parser(prog="train.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="a JSON file of flag values (names as below, with _), overridden by flags")
    add_model_flags(p)
    g = p.add_argument_group("layout: pp x dp_replicate x dp_shard x tp = world size")
    g.add_argument("--dp-replicate", type=int, default=1, help="replicas (DDP; HSDP with --dp-shard > 1)")
    g.add_argument("--dp-shard", type=int, default=-1, help="FSDP2 shards (-1: what the world size leaves)")
    g.add_argument("--tp", type=int, default=1, help="tensor parallel (sequence parallel, loss parallel)")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages (the micro-batches are --accum)")
    g.add_argument("--cp", type=int, default=1, help="context parallel: each sequence split over this many ranks "
                   "(ring attention, cp.py), taken out of --dp-shard")
    g.add_argument("--pp-schedule", choices=list(SCHEDULE_STAGES), default="1f1b", help="1f1b, gpipe: one stage "
                   "per rank; interleaved: two per rank, a smaller bubble; interleaved-zb: two per rank, the weight "
                   "gradients filling the bubble (zero bubble); zbv: refused, it cannot evaluate (notebook 08b)")
    add_moe_flags(p)
    g = p.add_argument_group("training")
    g.add_argument("--data", nargs="+", help="token files from `train.py prepare` (several: shards of one corpus; "
                   "default: CPython's language reference as bytes)")
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
    g.add_argument("--metrics", help="every step's loss, lr and gradient norm (JSON lines) in this file, each step "
                   "once: a run drops the lines past the step it starts from")
    g.add_argument("--tensorboard", metavar="DIR", help="the log line's figures as TensorBoard scalars (needs the "
                   "tensorboard package)")
    g.add_argument("--profile-steps", metavar="A:B", help="a torch.profiler trace of steps A to B (Chrome's JSON, "
                   "one file per rank, in --profile-dir)")
    g.add_argument("--profile-dir", default="profile")
    g.add_argument("--memory-snapshot", metavar="FILE", help="CUDA: the allocator's history from the start to step "
                   f"{SNAPSHOT_STEPS}, for pytorch.org/memory_viz (FILE_rank<r>.pickle)")
    g.add_argument("--ckpt-dir", help="DCP checkpoints here; a run resumes from the newest committed one")
    g.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0: at the end only)")
    g.add_argument("--keep", type=int, default=2, help="committed checkpoints kept (at least 1)")
    g.add_argument("--async-save", action="store_true", help="dcp.async_save: write while training goes on")
    g.add_argument("--stop-check-every", type=int, default=10, help="steps between the ranks' agreement on a "
                   "SIGTERM (one small all-reduce): a stopped job saves within this many steps")
    g.add_argument("--export", help="at the end, write the whole model to this file for inference (torch.save; "
                   "with --pp it needs --ckpt-dir and is made from the last checkpoint)")
    # test hooks, not in --help: after --crash-at the last rank sends itself --crash-signal (first attempt only)
    g.add_argument("--crash-at", type=int, help=argparse.SUPPRESS)
    g.add_argument("--crash-signal", choices=["KILL", "TERM"], default="KILL", help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags over --config over the device's defaults; every layout, size and data error here, before any process
    group exists (exit status 2, one line). Sets `args.model_config`, the model's shape."""
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
    try:
        defaults = GPU_DEFAULTS if uses_gpu() else CPU_DEFAULTS
    except ValueError as e:                      # more ranks on this node than GPUs
        parser.error(str(e))
    for key in ("model", "steps", "dtype", "compile", "lr"):
        if getattr(args, key) is None:
            setattr(args, key, defaults[key])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for key in ("tp", "pp", "cp", "ep", "dp_replicate", "accum", "steps", "log_every", "keep",
                "stop_check_every", *SHAPE_FLAGS[:4], "seq_len", "vocab_size"):
        if getattr(args, key) is not None and getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be at least 1, got {getattr(args, key)}")
    missing = [f for f in args.data or [] if not Path(f).is_file()]
    if missing:
        parser.error(f"--data {' '.join(missing)}: no such file (make one with: python train.py prepare --text ... "
                     "--out ...)")
    try:
        args.model_config = model_config(args)
    except ValueError as e:
        parser.error(str(e))
    if args.dp_shard == -1:
        args.dp_shard = world // (args.dp_replicate * args.tp * args.pp) or 1
    dp = args.dp_replicate * args.dp_shard // args.cp        # the ranks that read different batches
    if args.batch is None:
        args.batch = defaults["batch_per_dp_rank"] * dp * (args.accum if args.pp > 1 else 1)
    if args.warmup is None:
        args.warmup = max(1, args.steps // 20)
    try:
        layout(args).check(world, args.model_config, args.seq_len)
        if args.pp > 1:
            check_schedule(args.pp_schedule, args.pp, args.accum, args.model_config.n_layers, args.compile)
        if args.cp > 1:
            check_context_parallel(args.cp, args.dp_shard, args.tp, args.pp, args.seq_len, args.compile)
        check_moe(args)
        args.profile_steps = profile_window(args.profile_steps)
    except ValueError as e:
        parser.error(str(e))
    if args.batch % (dp * args.accum):
        parser.error(f"--batch {args.batch} must be a multiple of data-parallel ranks {dp} x --accum {args.accum}")

    if args.export and args.pp > 1 and not args.ckpt_dir:
        parser.error("--export with --pp needs --ckpt-dir: no rank holds the whole model, the checkpoint does")
    return args


def check_context_parallel(cp: int, dp_shard: int, tp: int, pp: int, seq_len: int, compiled: bool) -> None:
    """--cp's ranks come out of --dp-shard's (FSDP2 then averages their partial gradients with the others'); each
    rank takes 2 chunks of each sequence (cp.py's causal balance). Beside tensor or pipeline parallelism it is not
    built here, and torch.compile stops at the ring's point-to-point sends: ValueError, one line."""
    if dp_shard % cp:
        raise ValueError(f"--cp {cp} ranks are taken out of --dp-shard {dp_shard}: it must divide it")
    if tp > 1 or pp > 1:
        raise ValueError("--cp with --tp or --pp: not built in this recipe (context parallel over data parallel only)")
    if seq_len % (2 * cp):
        raise ValueError(f"--cp {cp} cuts each sequence into {2 * cp} equal chunks: --seq-len {seq_len} does not divide")
    if compiled:
        raise ValueError("--cp: torch.compile does not compile the ring's point-to-point sends: add --no-compile")


def check_schedule(name: str, pp: int, accum: int, n_layers: int, compiled: bool) -> None:
    """What torch's schedule would refuse on every rank after the process group exists, said here in one line:
    1F1B needs a micro-batch per stage; the interleaved schedules split theirs into accum // pp rounds; every stage
    holds a block at least; the zero-bubble schedules split each backward in two, which torch refuses on
    compiled blocks; ZBV cannot run forward only, which the evaluation needs (notebook 08b trains with it)."""
    chunks, _ = SCHEDULE_STAGES[name]
    if name == "1f1b" and accum < pp:
        raise ValueError(f"the 1f1b schedule needs --accum (micro-batches) >= --pp {pp}, got {accum}")
    if name.startswith("interleaved") and accum % max(1, accum // pp):
        raise ValueError(f"the {name} schedule splits its micro-batches into accum // pp rounds (torch's rule): "
                         f"--accum {accum} is not a multiple of its {max(1, accum // pp)} rounds")
    if n_layers < pp * chunks:
        raise ValueError(f"the {name} schedule places {pp * chunks} stages ({chunks} per rank): it needs as many "
                         f"layers, not {n_layers}")
    if name == "zbv":   # its forward-only run still steals the input gradients: "doesn't have backward"
        raise ValueError("the zbv schedule cannot evaluate (torch's ScheduleZBVZeroBubble has no forward-only run): "
                         "use interleaved-zb, the other zero-bubble schedule")
    if compiled and name == "interleaved-zb":
        raise ValueError(f"the {name} schedule splits each backward in two, and torch runs it on blocks that are "
                         "not compiled only: add --no-compile")


def model_config(args) -> LlamaArgs:
    """The model's shape: --init-from's config.json, else the preset with the shape flags; the sequence length
    (the model's max_seq_len unless a Hugging Face config gives one); the vocabulary: the token file's rounded up to
    a multiple of VOCAB_MULTIPLE unless the preset, --init-from or --vocab-size fixes it, and never smaller than the
    token file's (a token id past the embedding's rows is a device-side assert on a GPU). ValueError, one line."""
    tokens_vocab = data.vocab_size(args.data) if args.data else 256
    if args.init_from:
        cfg = ckpt.hf_model_config(args.init_from)
        held = {**dataclasses.asdict(cfg), "vocab_size": cfg.vocab_size}
        clash = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k in SHAPE_FLAGS + ("vocab_size",)
                 if getattr(args, k) is not None and getattr(args, k) != held[k]]
        if clash:
            raise ValueError(f"--init-from {args.init_from} fixes the model's shape: {', '.join(clash)} differ from "
                             "its config.json")
        args.seq_len = args.seq_len or cfg.max_seq_len
        if args.seq_len > cfg.max_seq_len:
            raise ValueError(f"--seq-len {args.seq_len} exceeds {args.init_from}'s max_position_embeddings "
                             f"{cfg.max_seq_len}")
    else:
        shape = {k: getattr(args, k) for k in SHAPE_FLAGS if getattr(args, k) is not None}
        args.seq_len = args.seq_len or PRESETS[args.model]["max_seq_len"]
        vocab = args.vocab_size or PRESETS[args.model].get("vocab_size") or \
            -(-tokens_vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        cfg = preset(args.model, **shape, vocab_size=vocab, max_seq_len=args.seq_len)
    if tokens_vocab > cfg.vocab_size:
        raise ValueError(f"the token file's vocabulary ({tokens_vocab}) exceeds the model's ({cfg.vocab_size})")
    return cfg


def profile_window(text) -> tuple[int, int] | None:
    """--profile-steps 'A:B' -> (A, B): the steps profiled, B included. ValueError, one line."""
    if text is None or isinstance(text, (list, tuple)):         # None, or a window already parsed
        return tuple(text) if text else None
    try:
        first, last = (int(v) for v in str(text).split(":"))
    except ValueError:
        raise ValueError(f"--profile-steps {text}: expected A:B, two step numbers") from None
    if not 1 <= first <= last:
        raise ValueError(f"--profile-steps {text}: expected 1 <= A <= B")
    return first, last


# ---------------------------------------------------------------------------------------------------------- training
def default_data() -> list[Path]:
    """CPython's language reference as byte tokens, prepared once per user (every rank may do it: the file is
    written under a temporary name and renamed, and every writer writes the same bytes)."""
    path = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llama-recipe" / "pydoc_topics.u8"
    if not data.meta_path(path).exists():
        data.prepare([data.default_corpus_text()], path)
    return [path]


class Built:
    """What the flags build on this rank, in order: its place in the named mesh, the model made parallel, the
    pipeline schedule, the optimizer and its schedule, the data loader, and the state a checkpoint holds."""

    def __init__(self, args, device: torch.device):
        self.args, self.device = args, device
        self.world = dist.get_world_size()
        cfg = self.cfg = args.model_config
        self.mesh = par.build_mesh(self.world, args.dp_replicate, args.dp_shard, args.tp, args.pp, device.type,
                                   cfg, args.seq_len)
        self.dp_rank, self.dp = par.dp_rank_and_size(self.mesh)
        self.cp_mesh = context_parallel_mesh(args, device.type)
        self.ep_mesh, self.expert_replicas = expert_meshes(args, device.type)
        self.data_rank, self.data_dp = self.dp_rank // args.cp, self.dp // args.cp   # cp peers read one batch
        self.tp_rank = self.mesh.get_local_rank("tp")
        self.dtype = DTYPES[args.dtype]
        self.fsdp = uses_fsdp(args)
        self.ddp = uses_ddp(args)
        chunks, style = SCHEDULE_STAGES[args.pp_schedule] if args.pp > 1 else (1, "loop")
        self.parts, self.model, self.train_model = build_model(args, cfg, self.mesh, device, self.dtype, chunks, style,
                                                               self.cp_mesh, self.ep_mesh)
        self.stages = [pipeline_stage(part, self.mesh["pp"], device, chunk, chunks, style)
                       for chunk, part in enumerate(self.parts)] if args.pp > 1 else []
        self.first_stage = args.pp == 1 or any(s.is_first for s in self.stages)    # a V: both ends on rank 0
        self.last_stage = args.pp == 1 or any(s.is_last for s in self.stages)
        if self.stages:
            self.schedule = self._schedule(args.pp_schedule, args.accum)
        self.eval_schedules = {}       # evaluation's, by micro-batch count (Trainer._pipeline_eval)
        # autocast where FSDP2's policy does not already compute in bf16
        self.autocast = self.dtype != torch.float32 and not self.fsdp
        self.optimizer, self.scheduler = build_optimizer(self.model, args)
        self.data_paths = [Path(p) for p in args.data] if args.data else default_data()
        self.local_batch = args.batch // self.data_dp        # per step; a micro-batch is this / accum
        micro = self.local_batch if args.pp > 1 else self.local_batch // args.accum
        self.loader = data.train_loader(self.data_paths, args.seq_len, micro, self.data_rank, self.data_dp,
                                        args.batch, args.seed)
        self.batches = None        # iter(loader) at the first step: after a checkpoint has set its position
        self.state = ckpt.TrainState(self.train_model, self.optimizer, self.scheduler, self.loader)

    def _schedule(self, name: str, n_microbatches: int):
        """A schedule over this rank's stages: the stage itself for one per rank, the list for several."""
        stages = self.stages if len(self.stages) > 1 else self.stages[0]
        return pipeline_schedule(stages, name, n_microbatches, cross_entropy)

    def _next(self):
        if self.batches is None:
            self.batches = iter(self.loader)
        return this_ranks_tokens(*next(self.batches), self.cp_mesh, self.device)


def layout(args) -> Layout:
    return Layout(args.dp_replicate, args.dp_shard, args.tp, args.pp)


def uses_fsdp(args) -> bool:
    """FSDP2 shards the model when the layout has shards, and also replicates it where DDP cannot (beside tensor
    or pipeline parallelism: FSDP2 over the replicas, with one shard each)."""
    return layout(args).fsdp


def uses_ddp(args) -> bool:
    """DDP replicates the whole model where the layout has replicas and nothing else."""
    return layout(args).ddp


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
    for flag, name in (("cp", "CP"), ("ep", "EP")):      # their ranks are some of the data-parallel ones
        if getattr(args, flag) > 1:
            parts[-1] += f" ({name} {getattr(args, flag)} among them)"

    return " x ".join(parts) or "one process"


def context_parallel_mesh(args, device_type: str):
    """The mesh of this rank's context-parallel peers, or None without --cp: cp consecutive ranks of each dp_shard
    group (torchtitan's dp_shard_cp). FSDP2 still shards over all of dp_shard, so its gradient average includes
    the peers' partial gradients, each over its part of the same sequences. A second mesh over the same ranks, not
    a dimension of build_mesh's: FSDP2 needs dp_shard as one dimension, and joining two dimensions into one takes
    DeviceMesh's private _flatten (torchtitan's way); expert_meshes does the same."""

    if args.cp == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    shape = (args.pp, args.dp_replicate, args.dp_shard // args.cp, args.cp, args.tp)
    return init_device_mesh(device_type, shape, mesh_dim_names=("pp", "dp_replicate", "dp_data", "cp", "tp"))["cp"]


def this_ranks_tokens(x, y, cp_mesh, device: torch.device):
    """A batch's inputs and targets as this rank computes on them: with --cp its two chunks of each sequence."""
    if cp_mesh is not None:
        x, y = cp_shard(x, cp_mesh), cp_shard(y, cp_mesh)
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def build_model(args, cfg: LlamaArgs, mesh, device: torch.device, dtype: torch.dtype, chunks: int = 1,
                style: str = "loop", cp_mesh=None, ep_mesh=None):
    """The model made parallel by the layout, in torchtitan's order: built on the meta device, cut into this rank's
    pipeline stage, tensor parallel, activation checkpointing, compiled, sharded by FSDP2; then to_empty and
    init_weights make this rank's pieces real (or --init-from's weights, each rank reading only the tensors its
    pieces come from). A schedule with `chunks` stages per rank gets one model per stage, each cut from its own
    copy (placed as `style` says). Returns (this rank's models, one per stage; the model the optimizer and the
    checkpoint see: the one, or a StagesView of the several; the module the step calls: DDP's or the model)."""
    parts = [build_part(args, cfg, mesh, device, dtype, chunk, chunks, style, cp_mesh, ep_mesh)
             for chunk in range(chunks)]
    model = parts[0] if chunks == 1 else StagesView(parts)
    return parts, model, par.apply_ddp(model, mesh["dp_replicate"], device) if uses_ddp(args) else model


def build_part(args, cfg: LlamaArgs, mesh, device: torch.device, dtype: torch.dtype, chunk: int = 0,
               chunks: int = 1, style: str = "loop", cp_mesh=None, ep_mesh=None):
    """build_model's model, or with a pipeline the stage `chunk` of this rank's `chunks`; with `cp_mesh`, its
    attention a ring over the context-parallel ranks; with --moe-experts, experts (over `ep_mesh`'s ranks)."""
    with torch.device("meta"):                    # no memory yet: each rank materializes only its pieces
        model = Llama(cfg)
    shared_out = apply_experts(model, args, ep_mesh)     # the experts --ep shares out, which FSDP2 leaves alone
    if args.pp > 1:
        model = pipeline_split(model, mesh["pp"], chunk, chunks, style)
    if cp_mesh is not None:
        apply_cp(model, cp_mesh)
    if args.tp > 1:
        apply_tp(model, mesh["tp"], loss_parallel=True)
    apply_ac(model, args.ac)
    if args.compile:
        apply_compile(model)
    if uses_fsdp(args):
        dims = ("dp_replicate", "dp_shard") if args.dp_replicate > 1 else ("dp_shard",)
        par.apply_fsdp(model, mesh[dims], param_dtype=dtype if dtype != torch.float32 else None,
                       reshard_after_forward=args.pp == 1, ignored_params=shared_out)
    model.to_empty(device=device)
    model.init_weights(args.seed)
    if args.init_from and not (args.ckpt_dir and ckpt.latest(args.ckpt_dir)):     # a resume wins
        ckpt.load_hf(model, args.init_from)
    return model


# ------------------------------------------------------------------------- mixture of experts (notebook 08b's moe.py)
def add_moe_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mixture of experts (notebook 08b)")
    g.add_argument("--moe-experts", type=int, default=0, help="each block's feed-forward becomes this many SwiGLU "
                   "experts of its size, top-k routed per token, dropless (0: the dense Llama)")
    g.add_argument("--moe-top-k", type=int, default=2, help="experts per token")
    g.add_argument("--ep", type=int, default=1, help="expert parallel: the experts shared out over this many ranks, "
                   "the tokens sent to them by all-to-all; taken out of --dp-shard")
    g.add_argument("--moe-aux-weight", type=float, default=0.01, help="the load-balancing loss's weight (Switch "
                   "Transformer's), over each rank's micro-batch")


def check_moe(args) -> None:
    """What --moe-experts and --ep need, in one line (ValueError): experts beside data parallelism only; --ep ranks
    out of --dp-shard's, each holding experts / ep of them; eager blocks; a model whose file and checkpoint a dense
    Llama's readers (export, generate.py, --init-from) would misread is refused before it is trained."""
    if args.moe_experts < 0 or (args.ep > 1 and not args.moe_experts):
        raise ValueError(f"--ep {args.ep} shares out experts: it needs --moe-experts > 0 (got {args.moe_experts})")
    if not args.moe_experts:
        return
    if not 1 <= args.moe_top_k <= args.moe_experts:
        raise ValueError(f"--moe-top-k {args.moe_top_k} must be between 1 and --moe-experts {args.moe_experts}")
    if args.tp > 1 or args.pp > 1 or args.cp > 1:
        raise ValueError("--moe-experts with --tp, --pp or --cp: not built in this recipe (experts beside data "
                         "parallel only)")
    if args.dp_shard % args.ep or args.moe_experts % args.ep:
        raise ValueError(f"--ep {args.ep} ranks come out of --dp-shard {args.dp_shard} and share out "
                         f"{args.moe_experts} experts: it must divide both")
    if args.compile:
        raise ValueError("--moe-experts: torch.compile stops at the router's data-dependent row counts, not built "
                         "here: add --no-compile")
    if args.init_from or args.export:
        raise ValueError(f"--moe-experts with --{'init-from' if args.init_from else 'export'}: those read and write "
                         "the dense Llama, which has no experts")


def expert_meshes(args, device_type: str):
    """(this rank's expert-parallel peers, the ranks holding the same experts as it), or (None, None) without
    --ep: ep consecutive ranks of each dp_shard group share out the experts (torchtitan carves ep out of dp_shard
    too). Experts refuse tp, pp and cp, so the world is dp_replicate x dp_shard, ranks in that order."""
    if args.ep == 1:
        return None, None
    from torch.distributed.device_mesh import init_device_mesh

    world = args.dp_replicate * args.dp_shard
    mesh = init_device_mesh(device_type, (world // args.ep, args.ep), mesh_dim_names=("ep_replica", "ep"))
    return mesh["ep"], mesh["ep_replica"]


def apply_experts(model, args, ep_mesh) -> set | None:
    """--moe-experts: each block's feed-forward becomes an MoE (meta weights, before FSDP2). Without ep_mesh its
    experts are weights like the others (FSDP2 shards and averages them); with it, Shard(0) DTensors over the ep
    ranks, returned for FSDP2 to leave alone (its ignored_params; `average_expert_grads` reduces them)."""
    if not args.moe_experts:
        return None
    apply_moe(model, args.moe_experts, args.moe_top_k)
    if ep_mesh is None:
        return None
    apply_ep(model, ep_mesh)
    return {p for m in model.modules() if isinstance(m, MoE) for p in m.experts.parameters()}


def average_expert_grads(model, replicas, dp: int) -> None:
    """For the experts FSDP2 leaves alone, what it does for the other weights: an expert's gradient holds the
    tokens its ep group sent it (the all-to-all's backward brought them), so it is summed over the ranks that hold
    the same experts (`replicas`) and divided by every data-parallel rank: the global batch's mean, like the rest."""
    for moe in [m for m in model.modules() if isinstance(m, MoE) and m.ep_group is not None]:
        for p in moe.experts.parameters():
            grad = p.grad.to_local()
            if replicas.size() > 1:
                dist.all_reduce(grad, group=replicas.get_group())
            grad.div_(dp)


def balance_loss(model, args):
    """The load-balancing loss's share of the loss that backward takes (0 without experts). Over this rank's
    micro-batch, as Switch Transformer and torchtitan compute it, so a layout's ranks equal one process's
    micro-batches (--accum), not its whole batch."""
    return args.moe_aux_weight * moe_aux_loss(model) if args.moe_experts else 0.0


def moe_extra_flops(cfg: LlamaArgs, args) -> int:
    """Training FLOPs per token that experts add to the dense Llama's (config.flops_per_token): the router (dim x
    experts) and k - 1 more feed-forwards of the dense size. MFU counts the weights a token uses, not all of them.
    plan.py (notebook 10) counts the same from the shapes; tests/planner/test_plan_cp_moe.py holds the two equal."""

    if not args.moe_experts:
        return 0
    return 6 * cfg.n_layers * (cfg.dim * args.moe_experts + (args.moe_top_k - 1) * 3 * cfg.dim * cfg.hidden)


def parameter_count(cfg: LlamaArgs, args) -> int:
    """Every weight of the model as built: the dense Llama's, each block's feed-forward --moe-experts times over,
    and a router beside them."""
    per_block = (args.moe_experts - 1) * 3 * cfg.dim * cfg.hidden + cfg.dim * args.moe_experts
    return cfg.num_params() + (cfg.n_layers * per_block if args.moe_experts else 0)


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
    schedule. Built after FSDP2: its parameters are the sharded DTensors, so its state is sharded too. A group per
    weight decay and DTensor mesh: AdamW's foreach kernels take one mesh at a time (--ep's experts have their own)."""
    from torch.distributed.tensor import DTensor

    groups = {}
    for name, p in model.named_parameters():
        decay = 0.0 if name.endswith("norm.weight") else args.weight_decay
        mesh = p.device_mesh if isinstance(p, DTensor) else None
        groups.setdefault((decay, mesh), {"params": [], "weight_decay": decay})["params"].append(p)
    optimizer = torch.optim.AdamW(list(groups.values()), lr=args.lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.warmup, args.steps, args.min_lr_ratio))
    return optimizer, scheduler


def plain(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (the loss under loss_parallel is one), a tensor as is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class Stepper(Built):
    """`step()`: one optimizer step, collective (every rank calls it)."""

    def _context(self):
        """loss_parallel with TP (the logits split over the vocabulary), autocast where FSDP2 does not cast."""
        stack = contextlib.ExitStack()
        if self.args.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel
            stack.enter_context(loss_parallel())
        if self.autocast:
            stack.enter_context(torch.autocast(self.device.type, dtype=self.dtype))
        return stack

    def _accumulate(self) -> torch.Tensor:
        """--accum micro-batches, forward and backward; DDP all-reduces the gradients after the last one only
        (no_sync before). Returns this rank's mean loss (one micro-batch: its loss, with no division or sum)."""
        loss, accum = None, self.args.accum
        for m in range(accum):
            x, y = self._next()
            sync = m == accum - 1 or not self.ddp     # DDP: one gradient all-reduce per step
            with self._context(), (contextlib.nullcontext() if sync else self.train_model.no_sync()):
                micro_loss = cross_entropy(self.train_model(x), y)
                micro_loss = micro_loss / accum if accum > 1 else micro_loss
                (micro_loss + balance_loss(self.model, self.args) / accum).backward()   # MoE: + load balancing
            part = plain(micro_loss).detach()
            loss = part if loss is None else loss + part
        return loss

    def _through_stages(self, schedule_call, x, y) -> list:
        """A pipeline schedule's step or eval, called as this rank's stage needs: the first stage feeds the inputs,
        the last the targets; returns the last stage's micro-batch losses."""
        losses = []
        inputs = [x] if self.first_stage else []
        targets = {"target": y, "losses": losses} if self.last_stage else {}
        with self._context():
            schedule_call(*inputs, **targets)
        return losses

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over --accum micro-batches; returns (this rank's mean loss, or 0 off the last
        pipeline stage; the gradient norm before clipping)."""
        args = self.args
        if self.stages:
            losses = self._through_stages(self.schedule.step, *self._next())
            loss = torch.stack([plain(l).detach() for l in losses]).mean() if losses else \
                torch.zeros((), device=self.device)
        else:
            loss = self._accumulate()
        average_expert_grads(self.model, self.expert_replicas, self.dp)     # --ep: what FSDP2 does for the rest
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
        if self.world == 1:
            return value.detach().float().item()
        counted = self.last_stage and self.tp_rank == 0
        total = (value.detach().float() if counted else torch.zeros((), device=self.device)) / self.dp
        total = total.reshape(1).clone()
        dist.all_reduce(total)
        return total.item()

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the first --eval-windows held-out sequences (the same ones at every layout)."""
        args = self.args
        for part in self.parts:
            part.eval()
        total = torch.zeros((), device=self.device)
        count = 0
        for x, y in data.eval_batches(self.data_paths, args.seq_len, max(1, self.local_batch // args.accum),
                                      self.data_rank, self.data_dp, args.eval_windows):
            x, y = this_ranks_tokens(x, y, self.cp_mesh, self.device)
            if self.stages:
                total += self._pipeline_eval(x, y) * len(x)
            else:
                with self._context():
                    total += plain(cross_entropy(self.train_model(x), y)).detach() * len(x)
            count += len(x)
        for part in self.parts:
            part.train()
            if self.fsdp:
                part.reshard()          # a forward without backward leaves the root's weights gathered
        return self.global_mean(total / count)

    def _pipeline_eval(self, x, y) -> torch.Tensor:
        """One held-out batch through the pipeline stages, forward only where the schedule can (eval()); one
        schedule per micro-batch count for the whole run, built at its first use."""
        n = self.args.accum if len(x) % self.args.accum == 0 else 1
        if n not in self.eval_schedules:
            self.eval_schedules[n] = self._schedule("gpipe" if len(self.stages) == 1 else self.args.pp_schedule, n)
        schedule = self.eval_schedules[n]
        losses = self._through_stages(schedule.eval if hasattr(schedule, "eval") else schedule.step, x, y)
        self.optimizer.zero_grad(set_to_none=True)
        return torch.stack([plain(l) for l in losses]).mean() if losses else torch.zeros((), device=self.device)


# ---------------------------------------------------------------------------------------------------- measurements
def reset_peak_memory(device: torch.device) -> bool:
    """Start a window of peak memory: CUDA's allocator peaks; on a CPU the process's peak resident set (Linux:
    writing 5 to /proc/self/clear_refs resets VmHWM). False where it cannot be reset (the peak then runs from the
    process's start)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_memory(device: torch.device) -> tuple[int, int | None]:
    """(peak, peak reserved) bytes since `reset_peak_memory`. CUDA: the caching allocator's tensors, and what it
    held from the driver (reserved: what an out-of-memory error counts). CPU: the process's peak resident set,
    everything it holds (tensors, Python, libraries), nothing reserved apart."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    try:
        return int(re.search(r"^VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)[1]) * 1024, None
    except (OSError, TypeError):
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return (rss if sys.platform == "darwin" else rss * 1024), None


def log(rank: int, message: str) -> None:
    if rank == 0:
        print(message, flush=True)


def open_metrics(path: str | Path, start_step: int):
    """The --metrics file, opened to append (rank 0), holding each step once: the lines past `start_step` (what an
    attempt that died wrote after the checkpoint this run resumes from, or a run's own final evaluation when it is
    run again) are dropped first, the rest rewritten by a rename."""
    path, kept = Path(path), []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except ValueError:                      # a line cut short by a kill
            continue
        if record.get("step", 0) < start_step or (record.get("step") == start_step and not record.get("final")):
            kept.append(line + "\n")
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text("".join(kept))
    os.replace(partial, path)
    return open(path, "a", buffering=1)


def write_metrics(metrics, **values) -> None:
    """One JSON line in the --metrics file (open on rank 0 only: None elsewhere)."""
    if metrics:
        print(json.dumps(values), file=metrics)


class Window:
    """The steps since the last log line: their time less what was set aside (evaluation and checkpoints, shown
    apart, so that tokens/s and MFU are the training's), and this rank's peak memory over them."""

    def __init__(self, device: torch.device):
        self.device = device
        self.totals = {"eval": 0.0, "checkpoint": 0.0}          # seconds set aside over the whole run
        self.restart()

    def restart(self) -> float:
        """A new window of steps; returns its start (time.perf_counter)."""
        self.aside = dict.fromkeys(self.totals, 0.0)
        self.windowed = reset_peak_memory(self.device)          # False: the peak runs from the start
        self.start, self.steps = time.perf_counter(), 0
        return self.start

    @contextlib.contextmanager
    def set_aside(self, what: str):
        """The time spent inside is not training time: the log line shows it apart."""
        start = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            self.aside[what] += spent
            self.totals[what] += spent

    def training_seconds(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self.start - sum(self.aside.values())


class Meter(Window):
    """The log line's figures over a window: tokens/s, MFU, the largest peak memory of any rank. MFU is against
    the datasheet's dense peak of every rank's accelerator in the training dtype (hardware.py: the convention
    published figures use); the matmul rate the ranks measured at the start (their sum) is the second figure, and
    on a CPU, which has no datasheet row, the only one. One process takes part in no collective."""

    def __init__(self, args, cfg: LlamaArgs, device: torch.device, dtype: torch.dtype):
        self.world = dist.get_world_size()
        measured = torch.tensor([hardware.measured_matmul_peak(device, dtype)], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(measured)                           # the world's: the sum of the ranks'
        self.measured_peak = measured.item()
        sheet = hardware.datasheet_peak(torch.cuda.get_device_name(device), hardware.matmul_dtype_name(dtype)) \
            if device.type == "cuda" else None
        if sheet:
            self.peak = sheet[0] * self.world
            self.peak_source = f"{hardware.matmul_dtype_name(dtype)} datasheet peak x {self.world} ({sheet[1]})"
        else:
            self.peak = self.measured_peak
            self.peak_source = f"the matmul rate measured here (no datasheet row for {device.type} devices)"
        self.args, self.flops_per_token = args, cfg.flops_per_token(args.seq_len) + moe_extra_flops(cfg, args)
        self.tokens_per_step = args.batch * args.seq_len
        self.tokens_per_s = self.mfu = self.mfu_measured = self.memory_gib = 0.0
        self.reserved_gib = None
        super().__init__(device)

    def report(self, rank: int, step: int, loss: float, lr: float, norm: float) -> None:
        """Rank 0 prints the line for `step`; collective (the peak memory is the world's largest)."""
        elapsed = self.training_seconds()
        self.tokens_per_s = self.steps * self.tokens_per_step / elapsed
        self.mfu = self.tokens_per_s * self.flops_per_token / self.peak
        self.mfu_measured = self.tokens_per_s * self.flops_per_token / self.measured_peak
        peak, reserved = peak_memory(self.device)
        memory = torch.tensor([peak, reserved or 0], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(memory, op=dist.ReduceOp.MAX)
        self.memory_gib = memory[0].item() / 2 ** 30
        self.reserved_gib = memory[1].item() / 2 ** 30 if reserved is not None else None
        held = f"peak memory {self.memory_gib:.2f} GiB allocated, {self.reserved_gib:.2f} GiB reserved" \
            if self.reserved_gib is not None else \
            f"peak RSS {self.memory_gib:.2f} GiB{'' if self.windowed else ' (since the start)'}"
        aside = ", ".join(f"{k} {v:.1f} s" for k, v in self.aside.items() if v)
        left = (self.args.steps - step) * elapsed / self.steps
        log(rank, f"step {step:>6}/{self.args.steps}  loss {loss:.4f}  lr {lr:.2e}  grad_norm {norm:.3f}  tokens/s "
                  f"{self.tokens_per_s:,.0f}  MFU {100 * self.mfu:.1f}% ({100 * self.mfu_measured:.1f}% of "
                  f"measured)  {held}  {f'(not counted: {aside})  ' if aside else ''}time left {left:.0f} s")
        self.restart()

    def figures(self) -> dict:
        return {"tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "mfu_of_measured": self.mfu_measured,
                "peak_tflops": self.peak / 1e12, "peak_source": self.peak_source,
                "matmul_peak_tflops": self.measured_peak / 1e12, "peak_memory_gib": self.memory_gib,
                "peak_reserved_gib": self.reserved_gib, "eval_s": self.totals["eval"],
                "checkpoint_s": self.totals["checkpoint"]}


def resume(trainer: Trainer, args):
    """(the Checkpointer of --ckpt-dir or None, the checkpoint resumed from or None). `load_latest` puts the
    checkpoint rank 0 picks into the trainer's state (weights, optimizer state, schedule, data position), whatever
    layout wrote it, and each rank's random generators where the world size is the one that saved them (elsewhere
    they are reseeded from the seed, the rank and the step); the config saved beside each checkpoint lets
    `train.py export` rebuild the model."""
    if not args.ckpt_dir:
        return None, None
    config = {"model": dataclasses.asdict(trainer.cfg), "data": data.describe(trainer.data_paths),
              "args": {k: v for k, v in vars(args).items() if k != "model_config"}}
    checkpointer = ckpt.Checkpointer(args.ckpt_dir, args.keep, args.async_save, config)
    path = checkpointer.load_latest(trainer.state)
    if path is not None and not checkpointer.rng_restored:
        seed_generators(args.seed, dist.get_rank(), trainer.state.step)
    return checkpointer, path


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


def seed_generators(seed: int, rank: int, step: int = 0) -> None:
    """Seed this rank's global generators (the CPU's and the GPUs'), which dropout and any other code that draws
    without a generator of its own use: one stream per rank, saved with each checkpoint (checkpoint.save_rng). A
    resume at another world size, where the saved streams belong to no rank, reseeds from the step."""
    torch.manual_seed(((seed * 1_000_003 + rank) * 1_000_003 + step) % 2 ** 63)


class StopFlag:
    """SIGTERM (torchrun forwards it to every worker when it is stopped; SLURM sends it before the end of a job):
    finish the step, save, exit cleanly. The ranks must stop after the same step: they agree through one small
    all-reduce every `every` steps (not every step: that would be a host barrier per step), so a job stops within
    `every` steps of the signal. One process agrees with itself: it checks every step, with no collective."""

    def __init__(self, every: int):
        self.signal, self.every, self.world = 0, every, dist.get_world_size()
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.signal = signum

    def agreed(self, step: int) -> bool:
        """Collective on the steps that are multiples of `every` (every rank calls it after every step)."""
        if self.world == 1:
            return bool(self.signal)
        if step % self.every:
            return False
        flag = torch.tensor([self.signal], dtype=torch.int32)          # a CPU tensor: the gloo group carries it
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def plant_crash(args, step: int, rank: int, world: int) -> None:
    """--crash-at: after that step the last rank sends itself --crash-signal, on torchrun's first attempt only."""
    if args.crash_at == step and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0 and rank == world - 1:
        os.kill(os.getpid(), getattr(signal, f"SIG{args.crash_signal}"))
        time.sleep(0.1)                                  # let the handler run before the next check


# ------------------------------------------------------------------------------------------------ looking at a run
class Observers:
    """What --tensorboard, --profile-steps and --memory-snapshot write; none costs anything unless asked for. The
    TensorBoard scalars are rank 0's log line (the package is optional: without it the run says so in one line and
    goes on); the profiler's trace and the allocator's history (CUDA only: torch's private recorder, the one
    pytorch.org/memory_viz reads) are each rank's."""

    def __init__(self, args, device: torch.device, rank: int):
        self.args, self.device, self.rank, self.window = args, device, rank, args.profile_steps
        self.writer = self.profiler = self.range = None
        if args.tensorboard and rank == 0:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.writer = SummaryWriter(args.tensorboard)
            except ImportError:
                log(rank, "--tensorboard: the tensorboard package is not installed (pip install tensorboard); "
                          "training goes on without it")
        self.snapshot, self.steps = args.memory_snapshot if device.type == "cuda" else None, 0
        if args.memory_snapshot and device.type != "cuda":
            log(rank, f"--memory-snapshot: it records the CUDA allocator, which {device.type} ranks do not use")
        if self.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=100_000)   # from before the model is built

    def scalars(self, step: int, **values) -> None:
        for name, value in values.items():
            if self.writer and value is not None:
                self.writer.add_scalar(name, value, step)

    def before_step(self, step: int) -> None:
        if self.window and self.profiler is None and self.window[0] <= step <= self.window[1]:
            cuda = [torch.profiler.ProfilerActivity.CUDA] if self.device.type == "cuda" else []
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, *cuda])
            self.profiler.start()
        if self.profiler is not None:                   # each step a named range in the trace
            self.range = torch.profiler.record_function(f"train step {step}")
            self.range.__enter__()

    def after_step(self, step: int, last: bool = False) -> None:     # last: the run ends, write what records
        self.steps += 1
        if self.profiler is not None and self.range is not None:
            self.range.__exit__(None, None, None)
            self.range = None
        if self.profiler is not None and (step >= self.window[1] or last):
            self.profiler.stop()
            path = Path(self.args.profile_dir) / f"trace_rank{self.rank}_steps{self.window[0]}-{step}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            self.profiler.export_chrome_trace(str(path))
            self.profiler = self.window = None
            log(self.rank, f"step {step:>6}  profiler trace: {path} (and the other ranks'; ui.perfetto.dev opens it)")
        if self.snapshot and (self.steps >= SNAPSHOT_STEPS or last):
            torch.cuda.memory._dump_snapshot(f"{self.snapshot}_rank{self.rank}.pickle")
            torch.cuda.memory._record_memory_history(enabled=None)
            log(self.rank, f"step {step:>6}  memory snapshot: {self.snapshot}_rank*.pickle (pytorch.org/memory_viz)")
            self.snapshot = None

    def close(self, step: int) -> None:
        if self.profiler is not None or self.snapshot:
            self.after_step(step, last=True)
        if self.writer:
            self.writer.close()


def run_steps(trainer: Trainer, checkpointer, meter: Meter, observers: Observers, stop: StopFlag, metrics,
              args) -> tuple:
    """Train from the state's step to --steps (or to an agreed SIGTERM), logging, evaluating and saving on the
    way; returns (the last evaluation's loss or None, whether a signal stopped it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    first_step, eval_loss = trainer.state.step, None
    while trainer.state.step < args.steps:
        observers.before_step(trainer.state.step + 1)
        loss, norm = trainer.step()
        step = trainer.state.step
        meter.steps += 1
        observers.after_step(step)
        logged = step % args.log_every == 0 or step == args.steps or step == first_step + 1
        if args.metrics or logged:                         # collective: every rank takes part
            mean_loss, norm_value = trainer.global_mean(loss), norm.item()
            lr = trainer.scheduler.get_last_lr()[0]
            write_metrics(metrics, step=step, loss=mean_loss, lr=lr, grad_norm=norm_value)
        if logged:
            meter.report(rank, step, mean_loss, lr, norm_value)
            observers.scalars(step, loss=mean_loss, lr=lr, grad_norm=norm_value, tokens_per_s=meter.tokens_per_s,
                              mfu=meter.mfu, peak_memory_gib=meter.memory_gib, reserved_gib=meter.reserved_gib)
        if args.eval_every and step % args.eval_every == 0 and step < args.steps:
            with meter.set_aside("eval"):
                eval_loss = trainer.evaluate()
            log(rank, f"step {step:>6}  eval loss {eval_loss:.4f}")
            write_metrics(metrics, step=step, eval_loss=eval_loss)
            observers.scalars(step, eval_loss=eval_loss)
        if checkpointer and args.save_every and step % args.save_every == 0 and step < args.steps:
            with meter.set_aside("checkpoint"):
                checkpointer.save(trainer.state)
        elif checkpointer:
            checkpointer.poll()                            # an async save written since: committed now
        plant_crash(args, step, rank, world)
        if stop.agreed(step):
            log(rank, f"step {step:>6}  stopping on signal {stop.signal or 'from a peer'}: saving and exiting")
            return eval_loss, True
    return eval_loss, False


def train(device: torch.device, args) -> dict:
    """Build, resume if a checkpoint exists, train to --steps, evaluate, save; returns plain values only."""
    rank, world = dist.get_rank(), dist.get_world_size()
    seed_generators(args.seed, rank)
    stop = StopFlag(args.stop_check_every)                # from the start: a SIGTERM while building is kept
    observers = Observers(args, device, rank)             # first: a memory snapshot sees the model built
    trainer = Trainer(args, device)
    cfg = trainer.cfg
    meter = Meter(args, cfg, device, trainer.dtype)         # its matmul probe draws: before the generators load
    checkpointer, resumed = resume(trainer, args)
    source = f"resumed from {resumed}" if resumed else f"weights of {args.init_from}" if args.init_from else \
        "initialised"
    if resumed and not checkpointer.rng_restored:
        source += " (its random generators were saved at another world size: reseeded)"
    experts = f", {args.moe_experts} experts a block, top {args.moe_top_k}" if args.moe_experts else ""
    log(rank, f"training a {parameter_count(cfg, args) / 1e6:.2f}M-parameter Llama ({cfg.n_layers} layers, dim "
              f"{cfg.dim}, {cfg.n_heads} heads, {cfg.n_kv_heads} key/value heads{experts}, vocabulary "
              f"{cfg.vocab_size}) on {world} {device.type} rank{'s' * (world > 1)} as {layout_name(args)}, {args.dtype}"

              f"{', compiled' if args.compile else ''}: steps {trainer.state.step + 1} to {args.steps} of "
              f"{args.batch} x {args.seq_len} tokens, {source}; MFU against {meter.peak / 1e12:.4g} TFLOP/s, "
              f"{meter.peak_source}; measured matmul peak {meter.measured_peak / 1e12:.3g} TFLOP/s in all; a line "
              f"every {args.log_every} steps with the time left")
    if checkpointer and checkpointer.others:
        log(rank, f"left alone in {args.ckpt_dir}: {' '.join(p.name for p in checkpointer.others)} (another job's)")
    metrics = open_metrics(args.metrics, trainer.state.step) if args.metrics and rank == 0 else None
    started = meter.restart()
    try:
        eval_loss, stopped = run_steps(trainer, checkpointer, meter, observers, stop, metrics, args)
        if not stopped:
            with meter.set_aside("eval"):
                eval_loss = trainer.evaluate()
            log(rank, f"step {trainer.state.step:>6}  eval loss {eval_loss:.4f}")
            write_metrics(metrics, step=trainer.state.step, eval_loss=eval_loss, final=True)
            observers.scalars(trainer.state.step, eval_loss=eval_loss)
        with meter.set_aside("checkpoint"):
            save_and_export(trainer, checkpointer, args, rank, stopped)
    finally:
        observers.close(trainer.state.step)
        if metrics:
            metrics.close()
    dist.barrier()
    return {"rank": rank, "step": trainer.state.step, "eval_loss": eval_loss, "stopped": stopped,
            "seconds": time.perf_counter() - started, **meter.figures(), "parameters": parameter_count(cfg, args),

            "world_size": world, "device": device.type,
            "checkpoint": str(ckpt.latest(args.ckpt_dir)) if args.ckpt_dir else None}


def export_main(argv: list[str]) -> None:
    parser = Parser(prog="train.py export", description="The whole model from a committed checkpoint (any layout), "
                    "for inference: one torch.save file (--format pt), or a Hugging Face Llama folder (--format hf: "
                    "config.json, model.safetensors and the token file's tokenizer.json) that "
                    "LlamaForCausalLM.from_pretrained, vLLM and evaluation harnesses open.")
    parser.add_argument("--ckpt-dir", required=True, help="a --ckpt-dir of a training run, or one step_N in it")
    parser.add_argument("--out", required=True, help="the file (pt) or folder (hf) to write")
    parser.add_argument("--format", choices=["pt", "hf"], default="pt")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="hf: the weights' dtype")
    args = parser.parse_args(argv)
    path = Path(args.ckpt_dir)
    source = path if (path / ".metadata").exists() else ckpt.latest(path)
    if source is None:
        parser.error(f"no committed checkpoint in {path}")
    try:
        if args.format == "hf":
            ckpt.export_hf(source, args.out, DTYPES[args.dtype])
        else:
            ckpt.export(source, args.out)
    except ValueError as e:           # a checkpoint these exports cannot read (one of experts): one line, status 2
        parser.error(str(e))

    print(f"exported {source} to {args.out} ({args.format})", flush=True)


@record   # a failing rank's traceback goes into torchrun's error file, and its summary names the root cause
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["prepare"]:
        return data.main(argv[1:])
    if argv[:1] == ["export"]:
        return export_main(argv[1:])
    args = parse_args(argv)
    try:
        result = run_distributed(train, args)
    except ckpt.CheckpointError as e:              # every rank refuses alike: one line each, exit status 2
        print(f"train.py: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    if result["rank"] == 0:
        print("summary: " + json.dumps({k: v for k, v in result.items() if k != "rank"}), flush=True)

if __name__ == "__main__":
    main()
