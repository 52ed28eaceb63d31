# From the PyTorch distributed cookbook: the cells tagged 'script:train/train.py' in
#   notebooks/09_from_notebook_to_cluster.ipynb
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
"""Train the Llama of model.py under torchrun, at any layout of data, tensor, pipeline, context and expert parallelism.

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
stay the same). The flags, their rules and the model's counts are job.py's; what a run measures is measure.py's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record

import checkpoint as ckpt
import data
import float8
import parallelize as par
from ac import apply_ac, apply_compile
from config import MESH_DIMS
from cp import apply_cp, cp_shard
from distributed import run_distributed, uses_gpu
from job import Job, ParallelDims, Parser, flops_per_token, from_flags, parameter_count, parser
from measure import Meter, Observers, log, open_metrics, replica_mean, write_metrics
from model import Llama, cross_entropy
from moe import MoE, apply_ep, apply_moe, moe_aux_loss
from pipeline import SCHEDULE_STAGES, StagesView, pipeline_schedule, pipeline_split, pipeline_stage
from tp import apply_tp

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


# ---------------------------------------------------------------------------------------------------------- flags
def build_parser():
    """train.py's command line: job.py's table of flags, with pipeline.py's schedules as --pp-schedule's choices."""
    return parser("train", __doc__, choices={"pp_schedule": tuple(SCHEDULE_STAGES)})


def parse_args(argv: list[str] | None = None) -> Job:
    """The Job of the flags over --config over the device's defaults; every layout, size and data error here,
    before any process group exists (exit status 2, one line): what reads files is here (--config, --data's
    vocabulary, --init-from's config.json), what is ruled is job.py's."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.config:
        try:
            values = json.loads(Path(args.config).read_text())
        except (OSError, ValueError) as e:
            p.error(f"--config {args.config}: {e}")
        unknown = sorted(set(values) - {a.dest for a in p._actions})
        if unknown:
            p.error(f"--config {args.config}: unknown keys {unknown}")
        p.set_defaults(**values)
        args = p.parse_args(argv)
    missing = [f for f in args.data or [] if not Path(f).is_file()]
    if missing:
        p.error(f"--data {' '.join(missing)}: no such file (make one with: python train.py prepare --text ... "
                "--out ...)")
    try:
        device = "gpu" if uses_gpu() else "cpu"          # ValueError: more ranks on this node than GPUs
        tokens_vocab = data.vocab_size(args.data) if args.data else 256
        hf = ckpt.hf_model_config(args.init_from) if args.init_from else None
        job = from_flags(args, int(os.environ.get("WORLD_SIZE", "1")), device, tokens_vocab, hf,
                         stages_per_rank=SCHEDULE_STAGES[args.pp_schedule][0])
        float8_device_fits(job, device == "gpu")
        return job
    except ValueError as e:
        p.error(str(e))


def float8_device_fits(job: Job, gpu: bool) -> None:
    """What --float8 asks of this machine (job.py's float8_fits rules the rest): a GPU with float8 tensor cores
    (float8.check_float8_device); on a CPU torchao's emulation, which torch.compile does not take (torchtitan's rule)."""
    if job.float8 and gpu:
        rank = int(os.environ.get("LOCAL_RANK", "0"))
        float8.check_float8_device(torch.cuda.get_device_name(rank), torch.cuda.get_device_capability(rank),
                                   rocm=torch.version.hip is not None)
    elif job.float8 and job.compile:
        raise ValueError("--float8 on CPUs is torchao's emulation, which runs eager: add --no-compile")


def default_data() -> list[Path]:
    """CPython's language reference as byte tokens, prepared once per user (every rank may do it: the file is
    written under a temporary name and renamed, and every writer writes the same bytes)."""
    path = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llama-recipe" / "pydoc_topics.u8"
    if not data.meta_path(path).exists():
        data.prepare([data.default_corpus_text()], path)
    return [path]


# ------------------------------------------------------------------------------------------------------------ build
@dataclasses.dataclass
class Meshes:
    """Every mesh of a job, built in one place from its degrees (torchtitan's ParallelDims.build_mesh): the named
    mesh (pp, dp_replicate, dp_shard, tp), and over the same ranks cp's and ep's, each cut out of dp_shard: cp
    consecutive ranks of each dp_shard group (torchtitan's dp_shard_cp), ep consecutive ranks sharing out the
    experts with `expert_replicas` the ranks that hold the same ones. Separate meshes, not dimensions of the named
    one: FSDP2 needs dp_shard whole, and joining two dimensions takes DeviceMesh's private _flatten."""

    world: DeviceMesh
    cp: DeviceMesh | None = None
    ep: DeviceMesh | None = None
    expert_replicas: DeviceMesh | None = None


def build_meshes(dims: ParallelDims, device_type: str) -> Meshes:
    """The job's meshes (its degrees are checked already: job.Job.check)."""
    meshes = Meshes(init_device_mesh(device_type, tuple(getattr(dims, d) for d in MESH_DIMS), mesh_dim_names=MESH_DIMS))
    if dims.cp > 1:
        shape = (dims.pp, dims.dp_replicate, dims.dp_shard // dims.cp, dims.cp, dims.tp)
        meshes.cp = init_device_mesh(device_type, shape, mesh_dim_names=("pp", "dp_replicate", "dp_data", "cp",
                                                                          "tp"))["cp"]
    if dims.ep > 1:           # experts refuse tp, pp and cp: the world is dp_replicate x dp_shard, ranks in order
        mesh = init_device_mesh(device_type, (dims.dp // dims.ep, dims.ep), mesh_dim_names=("ep_replica", "ep"))
        meshes.ep, meshes.expert_replicas = mesh["ep"], mesh["ep_replica"]
    return meshes


def build_model(job: Job, meshes: Meshes, device: torch.device, dtype: torch.dtype):
    """The model made parallel by the layout, in torchtitan's order: built on the meta device, cut into this rank's
    pipeline stage, context parallel, tensor parallel, activation checkpointing, compiled, sharded by FSDP2; then
    to_empty and init_weights make this rank's pieces real (or --init-from's weights, each rank reading only the
    tensors its pieces come from). A schedule with several stages per rank gets one model per stage, each cut from
    its own copy. Returns (this rank's models, one per stage; the model the optimizer and the checkpoint see: the
    one, or a StagesView of the several; the module the step calls: DDP's or the model)."""
    chunks, style = SCHEDULE_STAGES[job.pp_schedule] if job.pp > 1 else (1, "loop")
    parts = []
    for chunk in range(chunks):
        with torch.device("meta"):                # no memory yet: each rank materializes only its pieces
            model = Llama(job.model_config)
        shared_out = apply_experts(model, job, meshes.ep)     # the experts --ep shares out: FSDP2 leaves them alone
        if job.float8:              # before TP and FSDP2, which shard Float8Linear's weight as they shard a Linear's
            float8.apply_float8(model, job.float8, job.float8_all_gather, emulate=device.type != "cuda", tp=job.tp)
        if job.pp > 1:
            model = pipeline_split(model, meshes.world["pp"], chunk, chunks, style)
        if meshes.cp is not None:
            apply_cp(model, meshes.cp)
        if job.tp > 1:
            apply_tp(model, meshes.world["tp"], loss_parallel=True)
        apply_ac(model, job.ac)
        if job.compile:
            apply_compile(model)
        if job.dims.fsdp:
            dims = ("dp_replicate", "dp_shard") if job.dp_replicate > 1 else ("dp_shard",)
            par.apply_fsdp(model, meshes.world[dims], param_dtype=dtype if dtype != torch.float32 else None,
                           reshard_after_forward=job.pp == 1, ignored_params=shared_out)
        model.to_empty(device=device)
        model.init_weights(job.seed)
        if job.init_from and not (job.ckpt_dir and ckpt.latest(job.ckpt_dir)):     # a resume wins
            ckpt.load_hf(model, job.init_from)
        parts.append(model)
    model = parts[0] if chunks == 1 else StagesView(parts)
    return parts, model, par.apply_ddp(model, meshes.world["dp_replicate"], device) if job.dims.ddp else model


# ------------------------------------------------------------------------- mixture of experts (notebook 08b's moe.py)
def apply_experts(model, job: Job, ep_mesh) -> set | None:
    """--moe-experts: each block's feed-forward becomes an MoE (meta weights, before FSDP2). Without ep_mesh its
    experts are weights like the others (FSDP2 shards and averages them); with it, Shard(0) DTensors over the ep
    ranks, returned for FSDP2 to leave alone (its ignored_params; `average_expert_grads` reduces them)."""
    if not job.moe_experts:
        return None
    apply_moe(model, job.moe_experts, job.moe_top_k)
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


def balance_loss(model, job: Job):
    """The load-balancing loss's share of the loss that backward takes (0 without experts). Over this rank's
    micro-batch, as Switch Transformer and torchtitan compute it, so a layout's ranks equal one process's
    micro-batches (--accum), not its whole batch."""
    return job.moe_aux_weight * moe_aux_loss(model) if job.moe_experts else 0.0


def lr_lambda(warmup: int, steps: int, min_ratio: float):
    """Linear warm-up to the peak over `warmup` steps, then cosine decay to min_ratio x peak at `steps`."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def build_optimizer(model, job: Job):
    """AdamW, with weight decay on the matrices and embeddings only (not the norms' weights), and its learning-rate
    schedule. Built after FSDP2: its parameters are the sharded DTensors, so its state is sharded too. A group per
    weight decay and DTensor mesh: AdamW's foreach kernels take one mesh at a time (--ep's experts have their own)."""
    from torch.distributed.tensor import DTensor

    groups = {}
    for name, p in model.named_parameters():
        decay = 0.0 if name.endswith("norm.weight") else job.weight_decay
        mesh = p.device_mesh if isinstance(p, DTensor) else None
        groups.setdefault((decay, mesh), {"params": [], "weight_decay": decay})["params"].append(p)
    optimizer = torch.optim.AdamW(list(groups.values()), lr=job.lr, betas=(0.9, 0.95))
    if job.float8_all_gather:     # after each step, the next all-gathers' float8 scales: all in one all-reduce
        optimizer.register_step_post_hook(lambda *_: float8.precompute_scales(model))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(job.warmup, job.steps, job.min_lr_ratio))
    return optimizer, scheduler


def step_context(job: Job, dtype: torch.dtype, device: torch.device):
    """What a forward and backward run in: loss_parallel with TP (the logits split over the vocabulary), autocast
    where FSDP2's bf16 policy does not already compute in bf16."""
    stack = contextlib.ExitStack()
    if job.tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel
        stack.enter_context(loss_parallel())
    if dtype != torch.float32 and not job.dims.fsdp:
        stack.enter_context(torch.autocast(device.type, dtype=dtype))
    return stack


def plain(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (the loss under loss_parallel is one), a tensor as is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class Batches:
    """This rank's data: its share of each global batch (the cp peers read the same one and keep their chunks of
    each sequence) as an iterator the checkpoint records the position of (`loader`), and the held-out windows, the
    same ones at every layout."""

    def __init__(self, job: Job, dp_rank: int, dp: int, cp_mesh, device: torch.device):
        self.job, self.cp_mesh, self.device = job, cp_mesh, device
        self.rank, self.ranks = dp_rank // job.cp, dp // job.cp
        self.paths = [Path(p) for p in job.data] if job.data else default_data()
        self.local_batch = job.batch // self.ranks                # per step; a micro-batch is this / accum
        micro = self.local_batch if job.pp > 1 else self.local_batch // job.accum
        self.loader = data.train_loader(self.paths, job.seq_len, micro, self.rank, self.ranks, job.batch, job.seed)
        self.batches = None        # iter(loader) at the first step: after a checkpoint has set its position

    def next(self):
        if self.batches is None:
            self.batches = iter(self.loader)
        return self.place(*next(self.batches))

    def held_out(self):
        for x, y in data.eval_batches(self.paths, self.job.seq_len, max(1, self.local_batch // self.job.accum),
                                      self.rank, self.ranks, self.job.eval_windows):
            yield self.place(x, y)

    def place(self, x, y):
        """A batch's inputs and targets as this rank computes on them: with --cp its two chunks of each sequence."""
        if self.cp_mesh is not None:
            x, y = cp_shard(x, self.cp_mesh), cp_shard(y, self.cp_mesh)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)


class Pipeline:
    """This rank's pipeline stages (one, or two for the interleaved and zero-bubble schedules) and the job's
    schedule over them; evaluation's schedules, one per micro-batch count, built at their first use."""

    def __init__(self, job: Job, parts: list, pp_mesh, device: torch.device):
        chunks, style = SCHEDULE_STAGES[job.pp_schedule]
        self.job, self.parts, self.device = job, parts, device
        self.stages = [pipeline_stage(part, pp_mesh, device, chunk, chunks, style) for chunk, part in enumerate(parts)]
        self.first = any(s.is_first for s in self.stages)       # a V: both ends on rank 0
        self.last = any(s.is_last for s in self.stages)
        self.schedule, self.eval_schedules = self._schedule(job.pp_schedule, job.accum), {}

    def _schedule(self, name: str, n_microbatches: int):
        """A schedule over this rank's stages: the stage itself for one per rank, the list for several."""
        stages = self.stages if len(self.stages) > 1 else self.stages[0]
        return pipeline_schedule(stages, name, n_microbatches, cross_entropy)

    def _run(self, schedule_call, x, y, context) -> torch.Tensor:
        """A schedule's step or eval, called as this rank's stages need: the first feeds the inputs, the last the
        targets; the last stage's mean micro-batch loss (0 elsewhere)."""
        losses = []
        with context:
            schedule_call(*([x] if self.first else []), **({"target": y, "losses": losses} if self.last else {}))
        return torch.stack([plain(l).detach() for l in losses]).mean() if losses else \
            torch.zeros((), device=self.device)

    def step(self, x, y, context) -> torch.Tensor:
        return self._run(self.schedule.step, x, y, context)

    def evaluate(self, x, y, context) -> torch.Tensor:
        """Forward only where the schedule can (eval()); a step() in its place leaves no gradients behind."""
        n = self.job.accum if len(x) % self.job.accum == 0 else 1
        if n not in self.eval_schedules:
            self.eval_schedules[n] = self._schedule("gpipe" if len(self.stages) == 1 else self.job.pp_schedule, n)
        schedule = self.eval_schedules[n]
        loss = self._run(schedule.eval if hasattr(schedule, "eval") else schedule.step, x, y, context)
        for part in self.parts:
            part.zero_grad(set_to_none=True)
        return loss


class Trainer:
    """The job made real on this rank, composed of its parts: meshes, the parallel model (and its pipeline), the
    optimizer, the data, the state a checkpoint holds. `step()` and `evaluate()` are collective."""

    def __init__(self, job: Job, device: torch.device):
        self.job, self.device, self.dtype = job, device, DTYPES[job.dtype]
        self.meshes = build_meshes(job.dims, device.type)
        self.dp_rank, self.dp = par.dp_rank_and_size(self.meshes.world)
        self.parts, self.model, self.train_model = build_model(job, self.meshes, device, self.dtype)
        self.pipeline = Pipeline(job, self.parts, self.meshes.world["pp"], device) if job.pp > 1 else None
        self.counted = (job.pp == 1 or self.pipeline.last) and self.meshes.world.get_local_rank("tp") == 0
        self.optimizer, self.scheduler = build_optimizer(self.model, job)
        self.data = Batches(job, self.dp_rank, self.dp, self.meshes.cp, device)
        self.state = ckpt.TrainState(self.train_model, self.optimizer, self.scheduler, self.data.loader)

    def context(self):
        return step_context(self.job, self.dtype, self.device)

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over --accum micro-batches; returns (this rank's mean loss, or 0 off the last
        pipeline stage; the gradient norm before clipping)."""
        job = self.job
        loss = self.pipeline.step(*self.data.next(), self.context()) if self.pipeline else self._accumulate()
        average_expert_grads(self.model, self.meshes.expert_replicas, self.dp)     # --ep: what FSDP2 does
        norm = par.clip_grad_norm_(self.model.parameters(), job.clip, self.meshes.world["pp"] if job.pp > 1 else
                                   None) if job.clip > 0 else torch.zeros((), device=self.device)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        return loss, norm

    def _accumulate(self) -> torch.Tensor:
        """--accum micro-batches forward and backward (DDP: no_sync but the last); this rank's mean loss."""
        loss, accum = None, self.job.accum
        for m in range(accum):
            x, y = self.data.next()
            sync = m == accum - 1 or not self.job.dims.ddp
            with self.context(), (contextlib.nullcontext() if sync else self.train_model.no_sync()):
                micro = cross_entropy(self.train_model(x), y)
                micro = micro / accum if accum > 1 else micro       # one micro-batch: no division, no sum
                (micro + balance_loss(self.model, self.job) / accum).backward()   # MoE: + load balancing
            loss = plain(micro).detach() if loss is None else loss + plain(micro).detach()
        return loss

    def global_mean(self, value: torch.Tensor) -> float:
        return replica_mean(value, self.counted, self.dp)      # each replica once: tp peers, other stages add 0

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the first --eval-windows held-out sequences (the same ones at every layout)."""
        for part in self.parts:
            part.eval()
        total, count = torch.zeros((), device=self.device), 0
        for x, y in self.data.held_out():
            if self.pipeline:
                total += self.pipeline.evaluate(x, y, self.context()) * len(x)
            else:
                with self.context():
                    total += plain(cross_entropy(self.train_model(x), y)).detach() * len(x)
            count += len(x)
        for part in self.parts:
            part.train()
            if self.job.dims.fsdp:
                part.reshard()          # a forward without backward leaves the root's weights gathered
        return self.global_mean(total / count)


# ------------------------------------------------------------------------------------------- checkpoint and resume
def resume(trainer: Trainer):
    """(the Checkpointer of --ckpt-dir or None, the checkpoint resumed from or None). `load_latest` puts the
    checkpoint rank 0 picks into the trainer's state (weights, optimizer state, schedule, data position), whatever
    layout wrote it, and each rank's random generators where the world size is the one that saved them (elsewhere
    they are reseeded from the seed, the rank and the step); the config saved beside each checkpoint lets
    `train.py export` rebuild the model."""
    job = trainer.job
    if not job.ckpt_dir:
        return None, None
    config = {"model": dataclasses.asdict(job.model_config), "data": data.describe(trainer.data.paths),
              "args": job.flags()}
    checkpointer = ckpt.Checkpointer(job.ckpt_dir, job.keep, job.async_save, config)
    path = checkpointer.load_latest(trainer.state)
    if path is not None and not checkpointer.rng_restored:
        seed_generators(job.seed, dist.get_rank(), trainer.state.step)
    return checkpointer, path


def save_and_export(trainer: Trainer, checkpointer, stopped: bool) -> None:
    """The last step's checkpoint (unless saved already), waited for (an async save may still be writing); then
    --export: gathered from the live model, or with a pipeline (no rank holds it whole) from that checkpoint."""
    job, rank = trainer.job, dist.get_rank()
    if checkpointer:
        if checkpointer.saved_step != trainer.state.step:
            checkpointer.save(trainer.state)
        checkpointer.wait()
    if job.export and not stopped:
        if job.pp > 1:
            dist.barrier()                  # rank 0 committed the last save before the barrier
            if rank == 0:
                ckpt.export(ckpt.latest(job.ckpt_dir), job.export)
        else:
            ckpt.export_full_state_dict(trainer.train_model, job.model_config, job.export)
        log(rank, f"exported the model to {job.export}")


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


def plant_crash(job: Job, step: int, rank: int, world: int) -> None:
    """--crash-at: after that step the last rank sends itself --crash-signal, on torchrun's first attempt only."""
    if job.crash_at == step and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0 and rank == world - 1:
        os.kill(os.getpid(), getattr(signal, f"SIG{job.crash_signal}"))
        time.sleep(0.1)                                  # let the handler run before the next check


# ---------------------------------------------------------------------------------------------------------- the loop
def run_steps(trainer: Trainer, checkpointer, meter: Meter, observers: Observers, stop: StopFlag, metrics) -> tuple:
    """Train from the state's step to --steps (or to an agreed SIGTERM), logging, evaluating and saving on the
    way; returns (the last evaluation's loss or None, whether a signal stopped it)."""
    job, rank, world = trainer.job, dist.get_rank(), dist.get_world_size()
    first_step, eval_loss = trainer.state.step, None
    while trainer.state.step < job.steps:
        observers.before_step(trainer.state.step + 1)
        loss, norm = trainer.step()
        step = trainer.state.step
        meter.steps += 1
        observers.after_step(step)
        logged = step % job.log_every == 0 or step == job.steps or step == first_step + 1
        if job.metrics or logged:                          # collective: every rank takes part
            mean_loss, norm_value = trainer.global_mean(loss), norm.item()
            lr = trainer.scheduler.get_last_lr()[0]
        if logged:
            meter.report(rank, step, mean_loss, lr, norm_value)
            observers.scalars(step, loss=mean_loss, lr=lr, grad_norm=norm_value, tokens_per_s=meter.tokens_per_s,
                              mfu=meter.mfu, peak_memory_gib=meter.memory_gib, reserved_gib=meter.reserved_gib)
        if job.metrics or logged:                          # the log line's figures too: plan.py --calibrate reads them
            write_metrics(metrics, step=step, loss=mean_loss, lr=lr, grad_norm=norm_value, **(dict(
                tokens_per_s=meter.tokens_per_s, mfu=meter.mfu, peak_memory_gib=meter.memory_gib,
                reserved_gib=meter.reserved_gib) if logged else {}))
        if job.eval_every and step % job.eval_every == 0 and step < job.steps:
            with meter.set_aside("eval"):
                eval_loss = trainer.evaluate()
            log(rank, f"step {step:>6}  eval loss {eval_loss:.4f}")
            write_metrics(metrics, step=step, eval_loss=eval_loss)
            observers.scalars(step, eval_loss=eval_loss)
        if checkpointer and job.save_every and step % job.save_every == 0 and step < job.steps:
            with meter.set_aside("checkpoint"):
                checkpointer.save(trainer.state)
        elif checkpointer:
            checkpointer.poll()                            # an async save written since: committed now
        plant_crash(job, step, rank, world)
        if stop.agreed(step):
            log(rank, f"step {step:>6}  stopping on signal {stop.signal or 'from a peer'}: saving and exiting")
            return eval_loss, True
    return eval_loss, False


def train(device: torch.device, job: Job) -> dict:
    """Build, resume if a checkpoint exists, train to --steps, evaluate, save; returns plain values only."""
    rank, world, cfg = dist.get_rank(), dist.get_world_size(), job.model_config
    seed_generators(job.seed, rank)
    stop = StopFlag(job.stop_check_every)                 # from the start: a SIGTERM while building is kept
    observers = Observers(device, rank, job.tensorboard, job.profile_window, job.profile_dir, job.memory_snapshot)
    trainer = Trainer(job, device)                        # after the observers: a memory snapshot sees it built
    meter = Meter(job.batch * job.seq_len, flops_per_token(cfg, job.seq_len, job.moe_experts, job.moe_top_k),
                  job.steps, device, trainer.dtype,       # its matmul probe draws: before the generators load
                  float8.float8_flop_share(cfg, job.seq_len, job.tp) if job.float8 else 0.0)
    precision = job.dtype + (f", float8 {job.float8}{'' if device.type == 'cuda' else ' (emulated)'}" if job.float8
                             else "")
    checkpointer, resumed = resume(trainer)
    source = f"resumed from {resumed}" if resumed else f"weights of {job.init_from}" if job.init_from else \
        "initialised"
    if resumed and not checkpointer.rng_restored:
        source += " (its random generators were saved at another world size: reseeded)"
    experts = f", {job.moe_experts} experts a block, top {job.moe_top_k}" if job.moe_experts else ""
    log(rank, f"training a {parameter_count(cfg, job.moe_experts) / 1e6:.2f}M-parameter Llama ({cfg.n_layers} "
              f"layers, dim {cfg.dim}, {cfg.n_heads} heads, {cfg.n_kv_heads} key/value heads{experts}, vocabulary "
              f"{cfg.vocab_size}) on {world} {device.type} rank{'s' * (world > 1)} as "
              f"{job.dims.describe(job.pp_schedule)}, {precision}{', compiled' if job.compile else ''}: steps "
              f"{trainer.state.step + 1} to {job.steps} of {job.batch} x {job.seq_len} tokens, {source}; MFU against "
              f"{meter.peak / 1e12:.4g} TFLOP/s, {meter.peak_source}; measured matmul peak "
              f"{meter.measured_peak / 1e12:.3g} TFLOP/s in all; a line every {job.log_every} steps with the time left")
    if checkpointer and checkpointer.others:
        log(rank, f"left alone in {job.ckpt_dir}: {' '.join(p.name for p in checkpointer.others)} (another job's)")
    metrics = open_metrics(job.metrics, trainer.state.step) if job.metrics and rank == 0 else None
    write_metrics(metrics, step=trainer.state.step, run={   # what the run is: plan.py --calibrate plans from it
        "flags": job.flags(), "model": dataclasses.asdict(cfg), "world": world, "device": torch.cuda.get_device_name(
            device) if device.type == "cuda" else device.type, "peak_flops": meter.peak / world})
    started = meter.restart()
    try:
        eval_loss, stopped = run_steps(trainer, checkpointer, meter, observers, stop, metrics)
        if not stopped:
            with meter.set_aside("eval"):
                eval_loss = trainer.evaluate()
            log(rank, f"step {trainer.state.step:>6}  eval loss {eval_loss:.4f}")
            write_metrics(metrics, step=trainer.state.step, eval_loss=eval_loss, final=True)
            observers.scalars(trainer.state.step, eval_loss=eval_loss)
        with meter.set_aside("checkpoint"):
            save_and_export(trainer, checkpointer, stopped)
    finally:
        observers.close(trainer.state.step)
        if metrics:
            metrics.close()
    dist.barrier()
    return {"rank": rank, "step": trainer.state.step, "eval_loss": eval_loss, "stopped": stopped,
            "seconds": time.perf_counter() - started, **meter.figures(),
            "parameters": parameter_count(cfg, job.moe_experts), "world_size": world, "device": device.type,
            "checkpoint": str(ckpt.latest(job.ckpt_dir)) if job.ckpt_dir else None}


@record   # a failing rank's traceback goes into torchrun's error file, and its summary names the root cause
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["prepare"]:
        return data.main(argv[1:])
    if argv[:1] == ["export"]:
        return ckpt.export_main(argv[1:])
    job = parse_args(argv)
    try:
        result = run_distributed(train, job)
    except ckpt.CheckpointError as e:              # every rank refuses alike: one line each, exit status 2
        print(f"train.py: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    if result["rank"] == 0:
        print("summary: " + json.dumps({k: v for k, v in result.items() if k != "rank"}), flush=True)

if __name__ == "__main__":
    main()
