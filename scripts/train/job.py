# From the PyTorch distributed cookbook: the cells tagged 'script:train/job.py' in
#   notebooks/09_from_notebook_to_cluster.ipynb
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
"""What one training job is, torch-free, written once: the recipe (train.py), its planner (plan.py), selftest.py
and the benchmarks read it here, so that no rule, count or flag is stated twice (torchtitan's JobConfig and
ParallelDims, litgpt's typed arguments).

- `FLAGS`: every flag of train.py and plan.py, one row each. Both command lines are made from it (`parser`), and
  so is the `torchrun` line the planner prints (`argv`). Adding a flag is one `Flag(...)` row: train.py then reads
  it as `job.NAME`, and `argv` writes it.
- `Job`: the training settings, typed: a frozen dataclass with a field per train.py flag, and the model they build.
- `ParallelDims`: the degrees, dp_replicate x dp_shard x tp x pp ranks (the mesh: config.Layout), and cp and ep
  taken out of dp_shard's; `RULES`: every refusal of a job, each stated once, run by `Job.check` (one line each).
- the counts the recipe logs and the planner plans: parameters, active parameters, training FLOPs per token.

    job = from_flags(parser("train", __doc__).parse_args(argv), world=8, device="gpu")
    job.dims.fsdp, job.model_config.n_layers, flops_per_token(job.model_config, job.seq_len, job.moe_experts)
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
from dataclasses import dataclass, field

from config import PRESETS, LlamaArgs, Layout, preset
from float8 import MULTIPLE, RECIPES

CHECKPOINTING = ("none", "selective", "full", "alternate")      # --ac: per block (ac.py)
VOCAB_MULTIPLE = 64        # a vocabulary from the token file is rounded up to this (any --tp up to 64 divides it)
# What a flag left out means, by device: the preset 'small' in bf16 with torch.compile on GPUs, 'tiny' on CPUs
DEVICE_DEFAULTS = {
    "gpu": {"model": "small", "batch_per_dp_rank": 16, "steps": 1000, "dtype": "bf16", "compile": True, "lr": 6e-4},
    "cpu": {"model": "tiny", "batch_per_dp_rank": 8, "steps": 150, "dtype": "fp32", "compile": False, "lr": 3e-3},
}


@dataclass(frozen=True)
class Flag:
    """One flag, `--NAME` (with - for _), on the command lines `commands` names; on train.py's also a field of `Job`.
    `type` bool is a switch (--NAME/--no-NAME where the default is None, --NAME alone where it is False); list
    takes one or more values. `least`: a smaller value is refused (`at_least`). `shape`: a field of the model's shape
    (config.LlamaArgs) the flag sets. `plan`: what differs on plan.py's line (argparse's default, help, nargs, ...).
    `hidden`: a test hook, accepted and left out of --help. `choices` of another module's table (pipeline.py's
    schedules, plan.py's GPUs) are handed to `parser` by the command that imports it."""

    name: str
    type: type
    default: object = None
    help: str = ""
    group: str | None = "training"
    commands: tuple = ("train",)
    choices: tuple | None = None
    least: int | None = None
    shape: bool = False
    hidden: bool = False
    metavar: str | None = None
    plan: dict = field(default_factory=dict)


BOTH, PLAN = ("train", "plan"), ("plan",)
GROUPS = {"model": "the model: a preset changed by the shape flags, or a Hugging Face folder",
          "layout": "the layout: pp x dp_replicate x dp_shard x tp = world size; cp and ep out of dp_shard's ranks",
          "experts": "mixture of experts (notebook 08b)", "training": "training",
          "run": "evaluation, logging, checkpoints", "question": "the planner's question"}


def searched(name: str) -> dict:
    """plan.py's version of a layout degree: left out, every degree is tried."""
    return {"default": None, "help": f"fix {name} (default: try every degree)"}


MODEL_AND_LAYOUT = (
    Flag("config", str, None, "a JSON file of flag values (names as below, with _), overridden by flags", None),
    Flag("model", str, None, "a named shape (config.py's PRESETS), which the flags below change (default: 'small' "
         "on GPUs, 'tiny' on CPUs)", "model", BOTH, tuple(sorted(PRESETS)), plan={"help": "a named shape"}),
    Flag("init_from", str, None, "a Hugging Face Llama folder (config.json, *.safetensors): its shape, and its "
         "weights before the first step (a checkpoint in --ckpt-dir wins: that is a resume)", "model", BOTH,
         plan={"help": "a Hugging Face Llama folder: its config.json's shape (the torchrun line passes it on)"}),
    Flag("dim", int, group="model", commands=BOTH, least=1, shape=True),
    Flag("n_layers", int, group="model", commands=BOTH, least=1, shape=True),
    Flag("n_heads", int, group="model", commands=BOTH, least=1, shape=True),
    Flag("n_kv_heads", int, None, "key/value heads (grouped-query attention; default: the preset's)", "model", BOTH,
         least=1, shape=True),
    Flag("tie_embeddings", bool, None, "the output layer is the embedding (default: the preset's, untied)", "model",
         BOTH, shape=True),
    Flag("vocab_size", int, None, f"default: the token file's, rounded up to a multiple of {VOCAB_MULTIPLE}",
         "model", BOTH, least=1, shape=True),
    Flag("seq_len", int, None, "tokens per sequence (default: the model's max_seq_len)", "model", BOTH, least=1),
    Flag("dp_replicate", int, 1, "replicas (DDP; HSDP with --dp-shard > 1)", "layout", BOTH, least=1,
         plan=searched("dp_replicate")),
    Flag("dp_shard", int, -1, "FSDP2 shards (-1: what the world size leaves)", "layout", BOTH, least=1,
         plan=searched("dp_shard")),
    Flag("tp", int, 1, "tensor parallel (sequence parallel, loss parallel)", "layout", BOTH, least=1,
         plan={"default": None, "help": "fix tp (default: every degree within a node)"}),
    Flag("pp", int, 1, "pipeline stages (the micro-batches are --accum)", "layout", BOTH, least=1,
         plan=searched("pp")),
    Flag("cp", int, 1, "context parallel: each sequence split over this many ranks (ring attention, cp.py), taken "
         "out of --dp-shard", "layout", BOTH, least=1),
    Flag("pp_schedule", str, "1f1b", "1f1b, gpipe: one stage per rank; interleaved: two per rank, a smaller bubble; "
         "interleaved-zb: two per rank, the weight gradients filling the bubble (zero bubble); zbv: refused, it "
         "cannot evaluate (notebook 08b)", "layout", BOTH),
    Flag("moe_experts", int, 0, "each block's feed-forward becomes this many SwiGLU experts of its size, top-k "
         "routed per token, dropless (0: the dense Llama)", "experts", BOTH, least=0),
    Flag("moe_top_k", int, 2, "experts per token", "experts", BOTH, least=1),
    Flag("ep", int, 1, "expert parallel: the experts shared out over this many ranks, the tokens sent to them by "
         "all-to-all; taken out of --dp-shard", "experts", BOTH, least=1),
    Flag("moe_aux_weight", float, 0.01, "the load-balancing loss's weight (Switch Transformer's), over each rank's "
         "micro-batch", "experts"),
)


TRAINING = (
    Flag("data", list, None, "token files from `train.py prepare` (several: shards of one corpus; default: "
         "CPython's language reference as bytes)"),
    Flag("steps", int, None, "optimizer steps in all (a resumed run continues to it)", least=1),
    Flag("batch", int, None, "global batch: sequences per optimizer step over all data-parallel ranks (default: "
         "16 per data-parallel rank on GPUs, 8 on CPUs)", commands=BOTH, least=1,
         plan={"help": "global batch in sequences per step (default: one per GPU)"}),
    Flag("accum", int, 1, "micro-batches per step (gradient accumulation)", least=1),
    Flag("lr", float, None, "peak learning rate"),
    Flag("min_lr_ratio", float, 0.1, "the cosine decays to lr x this"),
    Flag("warmup", int, None, "linear warm-up steps (default: 5%% of --steps)"),
    Flag("weight_decay", float, 0.1, "AdamW's, on matrices and embeddings only"),
    Flag("clip", float, 1.0, "max gradient norm (0: no clipping)"),
    Flag("dtype", str, None, "bf16: FSDP2's mixed precision when sharded, autocast elsewhere (default: bf16 on GPUs, "
         "fp32 on CPUs)", commands=BOTH, choices=("bf16", "fp32"), plan={"default": "bf16"}),
    Flag("compile", bool, None, "torch.compile each block (default: on GPUs)", commands=BOTH,
         plan={"help": "torch.compile each block, as the recipe does on GPUs (default, but not with --cp or "
                       "--moe-experts, which the recipe runs eager)"}),
    Flag("float8", str, None, "each block's linear layers in float8 with torchao (float8.py): tensorwise, gathered "
         "in float8 by FSDP2, or rowwise, a scale per row; emulated on CPUs", commands=BOTH, choices=RECIPES),
    Flag("ac", str, "none", "activation checkpointing per block", commands=BOTH, choices=CHECKPOINTING,
         plan={"nargs": "+", "default": list(CHECKPOINTING), "help": "checkpointing modes to try (default: all)"}),
    Flag("seed", int, 0),
    Flag("eval_every", int, 0, "steps between evaluations (0: at the end only)", "run"),
    Flag("eval_windows", int, 64, "held-out sequences per evaluation", "run", least=1),
    Flag("log_every", int, 10, group="run", least=1),
    Flag("metrics", str, None, "every step's loss, lr and gradient norm (JSON lines) in this file, each step once: a "
         "run drops the lines past the step it starts from", "run"),
    Flag("tensorboard", str, None, "the log line's figures as TensorBoard scalars (needs the tensorboard package)",
         "run", metavar="DIR"),
    Flag("profile_steps", str, None, "a torch.profiler trace of steps A to B (Chrome's JSON, one file per rank, in "
         "--profile-dir)", "run", metavar="A:B"),
    Flag("profile_dir", str, "profile", group="run"),
    Flag("memory_snapshot", str, None, "CUDA: the allocator's history through the first steps, for "
         "pytorch.org/memory_viz (FILE_rank<r>.pickle)", "run", metavar="FILE"),
    Flag("ckpt_dir", str, None, "DCP checkpoints here; a run resumes from the newest committed one", "run"),
    Flag("save_every", int, 0, "steps between checkpoints (0: at the end only)", "run"),
    Flag("keep", int, 2, "committed checkpoints kept (at least 1)", "run", least=1),
    Flag("async_save", bool, False, "dcp.async_save: write while training goes on", "run"),
    Flag("stop_check_every", int, 10, "steps between the ranks' agreement on a SIGTERM (one small all-reduce): a "
         "stopped job saves within this many steps", "run", least=1),
    Flag("export", str, None, "at the end, write the whole model to this file for inference (torch.save; with --pp "
         "it needs --ckpt-dir and is made from the last checkpoint)", "run"),
    # test hooks: after --crash-at the last rank sends itself --crash-signal (torchrun's first attempt only)
    Flag("crash_at", int, None, group="run", hidden=True),
    Flag("crash_signal", str, "KILL", group="run", choices=("KILL", "TERM"), hidden=True),
)


QUESTION = (          # plan.py's own
    Flag("gpus", int, None, "how many GPUs", "question", PLAN, least=1, plan={"required": True}),
    Flag("gpu", str, "H100-80GB", "the GPU (plan.py's GPUS)", "question", PLAN),
    Flag("micro_batch", int, 1, "sequences per micro-batch per data-parallel rank", "question", PLAN, least=1),
    Flag("matmul_tflops", float, None, "your GPU's large bf16 matmul rate (notebook 05 measures it; default: the "
         "datasheet x the H200's measured share)", "question", PLAN),
    Flag("top", int, 8, "layouts to print", "question", PLAN, least=1),
    Flag("async_tp", bool, False, "TP's all-gathers and reduce-scatters overlapped with the matmuls they feed "
         "(torchtitan's async TP; the recipe does not build it)", "question", PLAN),
    Flag("calibrate", str, None, "a short run's --metrics file (train.py): plan from its achieved compute rate and "
         "memory", "question", PLAN, metavar="LOG"),
)
FLAGS = MODEL_AND_LAYOUT + TRAINING + QUESTION               # the table: add a flag as a row of its group
SHAPE_FLAGS = tuple(f.name for f in FLAGS if f.shape)          # the model's fields a flag sets


class Parser(argparse.ArgumentParser):
    """Bad flags: one line on stderr, exit status 2 (argparse's own error prints the whole usage first)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parser(command: str, description: str, choices: dict | None = None, epilog: str | None = None) -> Parser:
    """`command`'s command line ("train" or "plan"), made from FLAGS; `choices`: the values of the flags whose
    choices are another module's table."""
    p = Parser(prog=f"{command}.py", description=description, epilog=epilog,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    groups = {}
    for f in FLAGS:
        if command not in f.commands:
            continue
        kwargs = {"default": f.default, "help": argparse.SUPPRESS if f.hidden else f.help or None,
                  "choices": (choices or {}).get(f.name, f.choices), "metavar": f.metavar}
        if f.type is bool:
            kwargs["action"] = "store_true" if f.default is False else argparse.BooleanOptionalAction
        else:
            kwargs.update(type=str if f.type is list else f.type, nargs="+" if f.type is list else None)
        kwargs.update(f.plan if command == "plan" else {})
        where = p if f.group is None else groups.get(f.group) or groups.setdefault(
            f.group, p.add_argument_group(GROUPS[f.group]))
        where.add_argument("--" + f.name.replace("_", "-"),
                           **{k: v for k, v in kwargs.items() if v is not None or k == "default"})
    return p


def at_least(values: dict) -> None:
    """ValueError (one line) for a flag below its floor (Flag.least): a count of ranks, steps, layers, heads."""
    for f in FLAGS:
        value = values.get(f.name)
        if f.least is not None and value is not None and value < f.least:
            raise ValueError(f"--{f.name.replace('_', '-')} must be at least {f.least}, got {value}")


def argv(values: dict) -> list[str]:
    """train.py's flags for `values` ({name: value}; None left out), in FLAGS' order: the command line that runs
    them. ValueError for a name train.py has no flag for, or a value outside a flag's choices."""
    rows = {f.name: f for f in FLAGS if "train" in f.commands}
    unknown = sorted(set(values) - set(rows))
    if unknown:
        raise ValueError(f"train.py has no flag {', '.join('--' + n.replace('_', '-') for n in unknown)}")
    line = []
    for name, f in rows.items():
        value, flag = values.get(name), "--" + name.replace("_", "-")
        if value is None:
            continue
        if f.choices and value not in f.choices:
            raise ValueError(f"{flag} is one of {', '.join(f.choices)}, not {value!r}")
        if f.type is bool:
            line += [flag] if value else [] if f.default is False else ["--no-" + flag[2:]]
        else:
            line += [flag, *map(str, value if isinstance(value, (list, tuple)) else [value])]
    return line


@dataclass(frozen=True)
class ParallelDims(Layout):
    """A job's degrees (torchtitan's ParallelDims): config.Layout's four, dp_replicate x dp_shard x tp x pp ranks that
    make the world and its named mesh (FSDP2 or DDP), and two cut out of dp_shard's ranks: cp of them split each
    sequence (they read one batch), ep of them share out the experts. FSDP2 shards over all of dp_shard."""

    cp: int = 1
    ep: int = 1

    @property
    def data_ranks(self) -> int:
        """The ranks that read different batches: the data-parallel ones, cp of which share each."""
        return self.dp // self.cp

    def describe(self, schedule: str = "1f1b") -> str:
        """The layout in words, as the recipe's first line says it ("HSDP 2x2 x TP 2", "FSDP2 4 (CP 2 among them)")."""
        parts = [f"pipeline {self.pp} ({schedule})"] if self.pp > 1 else []
        if self.dp_replicate > 1 and self.dp_shard > 1:
            parts.append(f"HSDP {self.dp_replicate}x{self.dp_shard}")
        elif self.fsdp or self.ddp:
            parts.append(f"FSDP2 {self.dp}" if self.fsdp else f"DDP {self.dp_replicate}")
        if self.tp > 1:
            parts.append(f"TP {self.tp}")
        for name in ("cp", "ep"):                    # their ranks are some of the data-parallel ones
            if getattr(self, name) > 1:
                parts[-1] += f" ({name.upper()} {getattr(self, name)} among them)"
        return " x ".join(parts) or "one process"


def model_shape(values: dict, hf: LlamaArgs | None = None, tokens_vocab: int = 256) -> tuple[LlamaArgs, int]:
    """(the model, the sequence length) the flags in `values` describe: --init-from's config.json (`hf`), which a
    shape flag that differs from it is refused against, or the preset with the shape flags. The sequence: --seq-len,
    else the model's max_seq_len (a preset's model is as long as its sequences). The vocabulary: --vocab-size, the
    preset's, or the token file's rounded up to a multiple of VOCAB_MULTIPLE; never smaller than the token file's
    (`tokens_vocab`: a token id past the embedding's rows is a device-side assert on a GPU). ValueError, one line."""
    shape = {k: values[k] for k in SHAPE_FLAGS if values.get(k) is not None}
    if hf is not None:
        clash = [f"--{k.replace('_', '-')} {v}" for k, v in shape.items() if v != getattr(hf, k)]
        if clash:
            raise ValueError(f"--init-from {values['init_from']} fixes the model's shape: {', '.join(clash)} differ "
                             "from its config.json")
        cfg, seq_len = hf, values.get("seq_len") or hf.max_seq_len
    else:
        seq_len = values.get("seq_len") or PRESETS[values["model"]]["max_seq_len"]
        shape["vocab_size"] = shape.get("vocab_size") or PRESETS[values["model"]].get("vocab_size") or \
            -(-tokens_vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        cfg = preset(values["model"], **shape, max_seq_len=seq_len)
    if tokens_vocab > cfg.vocab_size:
        raise ValueError(f"the token file's vocabulary ({tokens_vocab}) exceeds the model's ({cfg.vocab_size})")
    return cfg, seq_len


def model_flags(cfg: LlamaArgs, init_from: str | None = None) -> dict:
    """The flags that build `cfg` (model_shape backwards; its max_seq_len is --seq-len's): --init-from a folder, or
    the first preset whose other fields are cfg's, with the shape flags that differ from it. ValueError where none
    does (a feed-forward width or rotary settings of its own: only --init-from can)."""
    if init_from:
        return {"init_from": init_from}
    for name, fields in PRESETS.items():
        if preset(name, max_seq_len=cfg.max_seq_len, **{k: getattr(cfg, k) for k in SHAPE_FLAGS}) == cfg:
            base = LlamaArgs(**fields)
            return {"model": name, **{k: getattr(cfg, k) for k in SHAPE_FLAGS if getattr(cfg, k) != getattr(base, k)
                                      or (k == "vocab_size" and "vocab_size" not in fields)}}
    raise ValueError("no preset of config.py with the recipe's shape flags makes this model (its feed-forward width "
                     "or rotary settings are its own): train it with --init-from a Hugging Face folder")


JOB_FIELDS = [f for f in FLAGS if "train" in f.commands]


@dataclass(frozen=True)
class Job(dataclasses.make_dataclass("Flags", [(f.name, f.type, field(default=f.default)) for f in JOB_FIELDS],
                                     frozen=True)):
    """A training job: a field per train.py flag (FLAGS' rows, with their types and defaults), and `model_config`,
    the model they build. `from_flags` makes one from the command line; plan.py makes one per layout it plans."""

    model_config: LlamaArgs | None = None

    @functools.cached_property
    def dims(self) -> ParallelDims:
        """The degrees, made once (the job is frozen)."""
        return ParallelDims(self.dp_replicate, self.dp_shard, self.tp, self.pp, self.cp, self.ep)

    @property
    def float8_all_gather(self) -> bool:
        """Tensorwise float8 where FSDP2 shards: each float8 weight all-gathered in 1 byte per element, its scale
        precomputed after each optimizer step (rowwise gathers in the training dtype: one scale per tensor only)."""
        return self.float8 == "tensorwise" and self.dims.fsdp and self.dp_shard > 1

    @property
    def profile_window(self) -> tuple[int, int] | None:
        """--profile-steps 'A:B' as (A, B), the steps profiled, B included (checked by `profile_window_is_steps`)."""
        return tuple(int(v) for v in self.profile_steps.split(":")) if self.profile_steps else None

    def flags(self) -> dict:
        """The flags' values (what a checkpoint records beside the model)."""
        return {f.name: getattr(self, f.name) for f in JOB_FIELDS}

    def check(self, world: int | None = None, stages_per_rank: int = 1) -> None:
        """Every rule (RULES), in order: ValueError, one line, for a job the recipe cannot run on `world` ranks
        (None: any world the degrees make) with a schedule of `stages_per_rank` stages per rank."""
        for rule in RULES:
            rule(self, world, stages_per_rank)


def from_flags(args, world: int, device: str, tokens_vocab: int = 256, hf: LlamaArgs | None = None,
               stages_per_rank: int = 1) -> Job:
    """The Job train.py's parsed flags describe on `world` ranks: `device`'s defaults (DEVICE_DEFAULTS) where a
    flag was left out, --dp-shard -1 as what the world leaves, the model (`model_shape`; `tokens_vocab` the token
    files', `hf` --init-from's config), the batch and the warm-up; checked. ValueError, one line."""
    values = {f.name: getattr(args, f.name) for f in JOB_FIELDS}
    defaults = DEVICE_DEFAULTS[device]
    values.update({k: defaults[k] for k in ("model", "steps", "dtype", "compile", "lr") if values[k] is None})
    if values["dp_shard"] == -1:
        values["dp_shard"] = world // (values["dp_replicate"] * values["tp"] * values["pp"]) or 1
    at_least(values)                                  # before the model: a zero would divide it
    cfg, values["seq_len"] = model_shape(values, hf, tokens_vocab)
    data_ranks = values["dp_replicate"] * values["dp_shard"] // values["cp"]
    if values["batch"] is None:
        values["batch"] = defaults["batch_per_dp_rank"] * data_ranks * (values["accum"] if values["pp"] > 1 else 1)
    values["warmup"] = max(1, values["steps"] // 20) if values["warmup"] is None else values["warmup"]
    job = Job(**values, model_config=cfg)
    job.check(world, stages_per_rank)
    return job


RULES = []      # every refusal of a job, in the order Job.check runs them


def rule(check):
    """A rule of the spec: `check(job, world, stages_per_rank)` raises ValueError (one line) for a job the recipe
    cannot run. train.py runs every rule at its start, plan.py on every layout it plans."""
    RULES.append(check)
    return check


@rule
def mesh_fits_model(job: Job, world: int | None, stages: int) -> None:
    """The mesh's four degrees against the world size and the model (config.Layout.check: the heads, vocabulary and
    sequence divide by tp, as many layers as stages, no pipelined tied output)."""
    job.dims.check(world, job.model_config, job.seq_len)


@rule
def sequence_fits_model(job: Job, world: int | None, stages: int) -> None:
    """The rotary tables and any position limit are the model's: no longer sequences."""
    if job.seq_len > job.model_config.max_seq_len:
        raise ValueError(f"--seq-len {job.seq_len} exceeds the model's max_seq_len {job.model_config.max_seq_len}"
                         + (f" ({job.init_from}'s max_position_embeddings)" if job.init_from else ""))


@rule
def schedule_can_run(job: Job, world: int | None, stages: int) -> None:
    """What torch's schedule would refuse on every rank after the process group exists, said at the start: 1F1B
    needs a micro-batch per stage; the interleaved schedules split theirs into accum // pp rounds; every stage holds
    a block at least; the zero-bubble schedules split each backward in two, which torch refuses on compiled blocks;
    ZBV cannot run forward only, which the evaluation needs (notebook 08b trains with it)."""
    name, pp, accum = job.pp_schedule, job.pp, job.accum
    if pp == 1:
        return
    if name == "1f1b" and accum < pp:
        raise ValueError(f"the 1f1b schedule needs --accum (micro-batches) >= --pp {pp}, got {accum}")
    if name.startswith("interleaved") and accum % max(1, accum // pp):
        raise ValueError(f"the {name} schedule splits its micro-batches into accum // pp rounds (torch's rule): "
                         f"--accum {accum} is not a multiple of its {max(1, accum // pp)} rounds")
    if job.model_config.n_layers < pp * stages:
        raise ValueError(f"the {name} schedule places {pp * stages} stages ({stages} per rank): it needs as many "
                         f"layers, not {job.model_config.n_layers}")
    if name == "zbv":   # its forward-only run still steals the input gradients: "doesn't have backward"
        raise ValueError("the zbv schedule cannot evaluate (torch's ScheduleZBVZeroBubble has no forward-only run): "
                         "use interleaved-zb, the other zero-bubble schedule")
    if job.compile and name == "interleaved-zb":
        raise ValueError(f"the {name} schedule splits each backward in two, and torch runs it on blocks that are "
                         "not compiled only: add --no-compile")


@rule
def context_parallel_fits(job: Job, world: int | None, stages: int) -> None:
    """--cp's ranks come out of --dp-shard's; each takes 2 chunks of each sequence (cp.py's causal balance); beside
    tensor or pipeline parallelism it is not built here, and torch.compile stops at the ring's sends."""
    cp = job.cp
    if cp == 1:
        return
    if job.dp_shard % cp:
        raise ValueError(f"--cp {cp} ranks are taken out of --dp-shard {job.dp_shard}: it must divide it")
    if job.tp > 1 or job.pp > 1:
        raise ValueError("--cp with --tp or --pp: not built in this recipe (context parallel over data parallel only)")
    if job.seq_len % (2 * cp):
        raise ValueError(f"--cp {cp} cuts each sequence into {2 * cp} equal chunks: --seq-len {job.seq_len} does not "
                         "divide")
    if job.compile:
        raise ValueError("--cp: torch.compile does not compile the ring's point-to-point sends: add --no-compile")


@rule
def experts_fit(job: Job, world: int | None, stages: int) -> None:
    """Experts beside data parallelism only; --ep's ranks out of --dp-shard's, each holding experts / ep of them;
    eager blocks; a model whose file and checkpoint a dense Llama's readers (export, generate.py, --init-from)
    would misread is refused before it is trained."""
    e, ep = job.moe_experts, job.ep
    if ep > 1 and not e:
        raise ValueError(f"--ep {ep} shares out experts: it needs --moe-experts > 0 (got {e})")
    if not e:
        return
    if job.moe_top_k > e:
        raise ValueError(f"--moe-top-k {job.moe_top_k} must be between 1 and --moe-experts {e}")
    if job.tp > 1 or job.pp > 1 or job.cp > 1:
        raise ValueError("--moe-experts with --tp, --pp or --cp: not built in this recipe (experts beside data "
                         "parallel only)")
    if job.dp_shard % ep or e % ep:
        raise ValueError(f"--ep {ep} ranks come out of --dp-shard {job.dp_shard} and share out {e} experts: it must "
                         "divide both")
    if job.compile:
        raise ValueError("--moe-experts: torch.compile stops at the router's data-dependent row counts, not built "
                         "here: add --no-compile")
    if job.init_from or job.export:
        raise ValueError(f"--moe-experts with --{'init-from' if job.init_from else 'export'}: those read and write "
                         "the dense Llama, which has no experts")


@rule
def batch_splits(job: Job, world: int | None, stages: int) -> None:
    """The global batch is cut into equal micro-batches on every rank that reads its own data."""
    ranks = job.dims.data_ranks
    if job.batch % (ranks * job.accum):
        raise ValueError(f"--batch {job.batch} must be a multiple of data-parallel ranks {ranks} x --accum {job.accum}")


@rule
def float8_fits(job: Job, world: int | None, stages: int) -> None:
    """--float8 converts each block's Linear layers (float8.py); experts' grouped matmuls are none, and the float8
    share of the FLOPs would miscount them. A float8 matmul sums over a multiple of 16 (torch._scaled_mm), and the
    weight gradient's sums over a rank's tokens: refused on a CPU too, so a run tried there holds on a GPU."""
    if not job.float8:
        return
    if job.moe_experts:
        raise ValueError("--float8 with --moe-experts: the experts' grouped matmuls are not Linear layers torchao "
                         "converts (not built in this recipe)")
    tokens = job.batch // (job.dims.data_ranks * job.accum) * job.seq_len // job.cp
    if tokens % MULTIPLE:
        raise ValueError(f"--float8: a rank multiplies {tokens} tokens per micro-batch, not a multiple of {MULTIPLE} "
                         "(the weight gradient's float8 matmul sums over them)")


@rule
def export_gathers_whole_model(job: Job, world: int | None, stages: int) -> None:
    """--export gathers the whole model; under a pipeline no rank holds it, so it comes from the last checkpoint."""
    if job.export and job.pp > 1 and not job.ckpt_dir:
        raise ValueError("--export with --pp needs --ckpt-dir: no rank holds the whole model, the checkpoint does")


@rule
def profile_window_is_steps(job: Job, world: int | None, stages: int) -> None:
    """--profile-steps is A:B, two step numbers, 1 <= A <= B."""
    if job.profile_steps is None:
        return
    try:
        first, last = (int(v) for v in job.profile_steps.split(":"))
    except ValueError:
        raise ValueError(f"--profile-steps {job.profile_steps}: expected A:B, two step numbers") from None
    if not 1 <= first <= last:
        raise ValueError(f"--profile-steps {job.profile_steps}: expected 1 <= A <= B")


def parameter_count(cfg: LlamaArgs, experts: int = 0) -> int:
    """Every weight of the model as built: the dense Llama's (config.LlamaArgs.num_params), with each block's
    feed-forward `experts` times over and a router (dim x experts) beside them (moe.py)."""
    extra = (experts - 1) * 3 * cfg.dim * cfg.hidden + cfg.dim * experts if experts else 0
    return cfg.num_params() + cfg.n_layers * extra


def active_parameter_count(cfg: LlamaArgs, experts: int = 0, top_k: int = 1) -> int:
    """The weights one token meets: every one of a dense model; with experts the router and top_k of the experts
    in each block (what FLOPs, and so MFU, count), not all of them."""
    extra = cfg.dim * experts + (top_k - 1) * 3 * cfg.dim * cfg.hidden if experts else 0
    return cfg.num_params() + cfg.n_layers * extra


def flops_per_token(cfg: LlamaArgs, seq_len: int, experts: int = 0, top_k: int = 1) -> int:
    """Training FLOPs per token: config.LlamaArgs.flops_per_token (6 per matmul weight, the attention scores
    without a causal discount: the convention published MFU uses), with the active weights of experts in place of
    the dense feed-forward's (6 per weight a token meets)."""
    return cfg.flops_per_token(seq_len) + 6 * (active_parameter_count(cfg, experts, top_k) - cfg.num_params())
