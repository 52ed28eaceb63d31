# From the PyTorch distributed cookbook: the cells tagged 'script:train/plan.py' in
#   notebooks/10_parallelism_planner.ipynb
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
"""Plan a parallel layout for the recipe's Llama before renting the GPUs: memory per GPU (allocated, and reserved
by the caching allocator), bytes on the wire per step, a step time, tokens/s and MFU, and the `torchrun` line of
the training recipe that runs it.

    python plan.py --model llama3-8b --gpus 64 --gpu H100-80GB --seq-len 8192 --batch 64
    python plan.py --model llama3-70b --gpus 256 --gpu H100-80GB --seq-len 8192 --ac full --float8 tensorwise
    python plan.py --model llama3-8b --gpus 64 --calibrate run.jsonl    # a short run's --metrics file

Why a planner next to the recipe: "which layout for my model on my GPUs?" is answered by arithmetic that is easy to
get almost right (ZeRO's 16 bytes per parameter, the Korthikanti et al. activation formula) and whose last 10 % is
what decides whether a run fits: FSDP2 pads each parameter's dim 0, autocast keeps bf16 copies of the weights and
casts a normed input once per projection, DTensor's sequence parallelism saves the all-gathered input of every
column-wise projection, the loss's backward holds three fp32 tensors of the whole vocabulary, the caching allocator
reserves more than it hands out. Every term here names the tensor it counts, so a notebook can hold it against what
a run on the reader's machine holds and sends, and against published runs (notebook 10).

The sections, in the order a plan is made (each opens with a line `# --- N. name`); context parallelism (--cp) and
experts (--moe-experts, --ep) sit in the sections they extend:
1. the GPUs and their rates: `GPUS`, `gpu_rates` (a datasheet, a reader's matmul, or solved from a measured run);
2. model state: `parameter_shapes`, `model_state` (FSDP2's padding, experts held whole under ep);
3. activations: `layer_activations` (the ring's and the experts' terms), `selective_block`, the pipeline's
   `schedule_order` and what it holds (`in_flight`), `activations`;
4. the memory a GPU reports: `memory` (allocated by phase, reserved), `allocator_overhead`;
5. communication: `communication` (FSDP2, DDP, tensor parallel, the cp ring, the experts' all-to-alls);
6. time: `step_time` (matmuls by shape, float8, attention or the ring, experts, elementwise traffic, collectives,
   async TP, the bubble replayed), `calibrate` (the compute rate a measured run implies);
7. the plan and the search: `plan`, `check_layout`, `fitting_layouts`;
8. the command line: `torchrun_command`, `describe`, `read_run_log` and `calibrated_rates` (--calibrate), `main`.

What the recipe takes and refuses, and what a model counts, is its job spec's (job.py: the flags, the rules, the
parameter and FLOP counts), imported here, so a plan is checked by the rules train.py runs and printed with its flags.
Imports the standard library, config.py, job.py and float8.py's shape rules (all torch-free; the names a notebook
needs, such as `preset` and `Layout`, are reachable here too), the recipe's hardware.py where a time is asked for,
pipeline.py (and with it torch) where a pipeline's bubble is, and torch in `count_parameters`: copy it with the
recipe.
Conventions:
- bytes are per rank; "held" counts the rank's own elements (a DTensor's local shard), "allocated" the storages
  behind them (FSDP2 keeps parameters and gradients in buffers padded to ceil(dim0 / N) rows on every rank);
- a layout is config.Layout (dp_replicate, dp_shard, tp, pp); ranks are numbered like `init_device_mesh` numbers
  a mesh of shape (pp, dp_replicate, dp_shard, tp): tp fastest;
- a step is `grad_accum` micro-batches of `batch_size` sequences of `seq_len` tokens on every data-parallel rank,
  run as the recipe (train.py, parallelize.py) runs it: FSDP2 reshards after forward and reduces every
  micro-batch, DDP reduces once per step, tensor parallelism is sequence-parallel with a parallel loss, a
  pipeline runs its schedule (1F1B, GPipe, interleaved, zero bubble: one or two stages per rank) with its FSDP2
  parameters gathered through the step; `Training` also carries float8, async TP and the
  recipe's --cp (cp of the dp_shard ranks split each sequence and read one batch) and --moe-experts, --moe-top-k,
  --ep (every feed-forward a mixture of experts, the experts sharded over ep of the dp_shard ranks);
- what a run measured shaped the terms: notebook 10 holds each against the recipe on CPU ranks (and a GPU's
  allocator where there is one) and against torchtitan's published runs, tests/planner/test_plan.py against hand-worked
  cases, published formulas and the same published runs.
"""


from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from config import MESH_DIMS, LlamaArgs, Layout, config_from_hf, stage_layers
from config import PRESETS, preset  # noqa: F401 (not used here: a notebook's P.preset(...), P.PRESETS)
from float8 import BLOCK_LINEARS, RECIPES, float8_datasheet_peak, float8_flop_share, float8_linear_names
from job import (CHECKPOINTING, Job, ParallelDims, active_parameter_count, argv, at_least, flops_per_token,
                 model_flags, model_shape, parameter_count, parser)


PRECISIONS = ("fp32", "bf16-autocast", "bf16-fsdp")
OPTIMIZERS = {"adamw": 2, "sgd": 1}   # fp32 state tensors per parameter: Adam's two moments; SGD's momentum buffer
# Each schedule's stages per rank (pipeline.py's SCHEDULE_STAGES, which imports torch: a test holds the two equal).
# zbv is left out: the recipe refuses it (it cannot evaluate).
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "interleaved-zb": 2}
# Context parallel attention: the recipe's cp.py ring (eager block matmuls), or torch's context_parallel as torchtitan
# runs it (each rank all-gathers the keys and values and runs fused attention on its queries)
CP_ATTENTION = ("ring", "allgather")
# The loss: the recipe's ChunkedCrossEntropy (model.py: it keeps the logits as they are and a float32 log-sum-exp per
# token), or F.cross_entropy on a float32 copy of the logits (torchtitan's; the recipe's too under tp's loss_parallel)
LOSSES = ("chunked", "float32")
# torchtitan's per-op policy: like the recipe's "selective" (keep matmul and attention outputs, recompute the rest),
# but every second matmul of a block is recomputed too, and a reduce-scatter's output is kept
TORCHTITAN_SELECTIVE = "selective-torchtitan"
GB, GIB = 1e9, 2 ** 30


@dataclass(frozen=True)
class Training:
    """What one optimizer step does on every data-parallel rank, and how. `compile`: each block torch.compile'd
    (the recipe's default on GPUs); `fused_rms_norm`: CUDA's rms_norm is one kernel, torch 2.13's CPU path composes
    it (see `layer_activations`). The recipe's --cp, --moe-experts, --moe-top-k, --ep and --pp-schedule are here,
    not in the Layout: cp's and ep's ranks are some of dp_shard's (job.ParallelDims), and Layout keeps the mesh's
    four dimensions (config.py). What the recipe refuses of them is job.py's rules (`check_layout`). float8, async
    TP and torch's all-gather context parallel are planned too, where the recipe does not build them
    (`not_in_recipe`): torchtitan's published runs use them."""

    seq_len: int = 1024
    batch_size: int = 8          # sequences per micro-batch per data-parallel rank
    grad_accum: int = 1          # micro-batches per step (the pipeline's micro-batches when pp > 1)
    optimizer: str = "adamw"
    precision: str = "fp32"
    checkpointing: str = "none"
    fused_rms_norm: bool = True
    compile: bool = False
    cp: int = 1                  # each sequence split over cp ranks (ring attention); batch_size is then per cp group
    moe_experts: int = 0         # every feed-forward an MoE of this many SwiGLU experts (0: dense)
    moe_top_k: int = 2           # experts per token
    ep: int = 1                  # the experts sharded over ep consecutive dp_shard ranks
    pp_schedule: str = "1f1b"    # the pipeline's schedule (SCHEDULES), the micro-batches are grad_accum
    stages_per_rank: int = 0     # 0: the schedule's own (SCHEDULES)
    float8: str | None = None    # the blocks' linear layers in float8 (torchao): "tensorwise" or "rowwise"
    async_tp: bool = False       # TP's collectives overlapped with the matmuls they feed (not built by the recipe)
    cp_attention: str = "ring"   # CP_ATTENTION
    loss: str = "chunked"        # LOSSES

    def __post_init__(self):
        at_least({"cp": self.cp, "ep": self.ep, "moe_experts": self.moe_experts, "moe_top_k": self.moe_top_k})
        for name, value, allowed in (("pp_schedule", self.pp_schedule, tuple(SCHEDULES)),
                                     ("float8", self.float8, RECIPES + (None,)),
                                     ("cp_attention", self.cp_attention, CP_ATTENTION), ("loss", self.loss, LOSSES)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, not {value!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, not {self.optimizer!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, not {self.precision!r}")
        if self.checkpointing not in CHECKPOINTING + (TORCHTITAN_SELECTIVE,):
            raise ValueError(f"checkpointing must be one of {CHECKPOINTING + (TORCHTITAN_SELECTIVE,)}, not "
                             f"{self.checkpointing!r}")

    @property
    def chunks(self) -> int:
        """Pipeline stages per rank: the schedule's, or `stages_per_rank` where given."""
        return self.stages_per_rank or SCHEDULES[self.pp_schedule]


# ------------------------------------------------------------------------------------------ 1. the GPUs and their rates

@dataclass(frozen=True)
class GPU:
    """What a step time and a fit need of a GPU besides its datasheet FLOP/s (hardware.py's table, looked up by
    `device`): the memory torch can use, the HBM rate, the SM count (matmul tiles fill waves of them), the links."""

    device: str            # the name torch reports (hardware.datasheet_peak matches it)
    memory: float          # bytes: torch.cuda.get_device_properties(...).total_memory
    hbm: float             # bytes/s, datasheet
    sms: int
    nvlink: float          # bytes/s per GPU per direction inside a node
    network: float         # bytes/s per GPU between nodes
    attention_efficiency: float   # fused attention's share of the datasheet FLOP/s (see ATTENTION_SOURCES)
    gpus_per_node: int = 8
    source: str = ""
    calibration: MeasuredRun | None = None   # a run on this GPU its compute rates are solved from (`calibrate`)


@dataclass(frozen=True)
class MeasuredRun:
    """A run's settings and what it measured: tokens/s per GPU and, where known, the allocator's peak (GiB). A short
    run of the recipe on the reader's GPUs (`read_run_log`, --calibrate) or a published one."""

    cfg: LlamaArgs
    train: Training
    layout: Layout
    tokens_per_s: float
    source: str
    allocated_gib: float | None = None
    reserved_gib: float | None = None


# torchtitan's H100s ran at 500 W, below the 700 W of the SXM datasheet, and its benchmark calls their peak unknown
# (between the SXM's and the NVL's). Their compute rates come from one of its published runs: the planner solves for
# the share of the datasheet that predicts it (`calibrate`), and every other published row is held against that.
H100_500W_RUN = MeasuredRun(
    preset("llama3-8b", max_seq_len=8192),
    Training(seq_len=8192, batch_size=2, precision="bf16-fsdp", checkpointing="selective-torchtitan", compile=True,
             loss="float32"),
    Layout(dp_shard=8), 6667, "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1, FSDP + "
    "torch.compile: Llama 3.1 8B on 8 H100s at 500 W, local batch 2 x 8192, per-op selective checkpointing",
    reserved_gib=77.0)

GPUS = {
    "H100-80GB": GPU("NVIDIA H100 80GB HBM3", 79.18 * GIB, 3.35e12, 132, 450e9, 50e9, 0.35,
                     source="H100 SXM datasheet (3.35 TB/s, NVLink 900 GB/s both ways), 400 Gb/s per GPU between "
                            "nodes (DGX H100); 79.18 GiB as torchtitan logs it"),
    "H100-96GB-500W": GPU("NVIDIA H100 96GB HBM2e (500 W)", 95.0396 * GIB, 2.4e12, 132, 450e9, 50e9, 0.35,
                          source="torchtitan's Grand Teton hosts as benchmarks/llama3_h100_202412_torchtitan.md "
                                 "states them (96 GB HBM2e at 2.4 TB/s, 500 W, 400 Gb/s per GPU); 95.0396 GiB as "
                                 "torchtitan PR #165 states it", calibration=H100_500W_RUN),
    "H200": GPU("NVIDIA H200", 139.81 * GIB, 4.8e12, 132, 450e9, 50e9, 0.35,
                source="H200 SXM datasheet (4.8 TB/s, NVLink 900 GB/s), 400 Gb/s per GPU; 139.81 GiB as torchtitan "
                       "logs it"),
    "A100-80GB": GPU("NVIDIA A100-SXM4-80GB", 79.25 * GIB, 2.039e12, 108, 300e9, 25e9, 0.50,
                     source="A100 80GB SXM datasheet (2,039 GB/s, NVLink 600 GB/s both ways), 200 Gb/s per GPU "
                            "between nodes (DGX A100); 79.25 GiB as torch reports it"),
}


# The rates a datasheet does not give, each from a named measurement (none is fitted to the runs notebook 10 compares):
# - a large bf16 matmul reaches 701.1 of the H200's 989.4 dense TFLOP/s: notebook 05 on one H200, docs/measurements.md
#   (2026-11-26, 8192^3); applied to every GPU's datasheet figure unless `--matmul-tflops` gives the reader's own;
# - a device copy moves 2 x 2085 GB/s of the H200's 4.8 TB/s (read and write): notebook 01b, same run;
# - fused attention (PyTorch's flash kernels are FlashAttention-2's) reaches 35 % of an H100 (FlashAttention-3 paper,
#   arXiv 2407.08608, on FlashAttention-2) and 50 % of an A100 (FlashAttention-2 paper, arXiv 2307.08691: 50-73 %;
#   the low end, as the backward, 2.5 times the forward's FLOPs, is the slower pass);
# - collectives reach 80 % of a link's rate as nccl-tests' bus bandwidth.
MEASURED_MATMUL = (701.1e12, "NVIDIA H200", "notebook 05 on one H200 (docs/measurements.md, 2026-11-26)")
MEMORY_EFFICIENCY = 2 * 2085e9 / 4.8e12
BUS_EFFICIENCY = 0.8
ATTENTION_SOURCES = "FlashAttention-2 on H100: 35 % (arXiv 2407.08608); on A100: 50-73 % (arXiv 2307.08691)"


FLOAT8_DTYPE = "float8"    # hardware.py's column of dense float8 (e4m3) FLOP/s


def hardware_peak(device: str, dtype: str) -> float:
    """Dense FLOP/s of `device` in `dtype` from hardware.py's table, 0 where it has none (an A100 has no float8)."""
    import hardware

    found = hardware.datasheet_peak(device, dtype)
    return found[0] if found else 0.0


def datasheet_flops(device: str, dtype: str = "bf16") -> tuple[float, str]:
    """(dense FLOP/s, source) of `device` in `dtype`, from the recipe's one datasheet table (hardware.py)."""
    import hardware

    found = hardware.datasheet_peak(device, dtype)
    if found is None:
        raise ValueError(f"no datasheet row for {device!r} in hardware.py")
    return found


@dataclass(frozen=True)
class Rates:
    """The rates a step time is made of: matmul FLOP/s of a large matmul in the compute dtype (smaller shapes lose
    tiles and waves of `sms`; 0: no such loss), fused attention's FLOP/s (FlashAttention-2's count: the backward is
    2.5 forwards), bytes/s of elementwise traffic (read + write), collectives' bus bandwidth inside and between
    nodes, the fixed cost of a call; `sources` says where each came from."""

    matmul: float
    attention: float
    memory: float
    intra: float
    inter: float
    latency: float = 30e-6
    gpus_per_node: int = 8
    sms: int = 0
    sources: tuple = ()
    float8: float = 0.0          # a large float8 matmul's FLOP/s (0: the GPU has no float8 matmul)

    def scaled(self, factor: float, why: str) -> Rates:
        """These rates with every compute rate (matmul, float8, attention) times `factor`: a clock other than the
        datasheet's (a power limit), or the reader's own measurement; `why` leads the sources."""
        return dataclasses.replace(self, matmul=self.matmul * factor, float8=self.float8 * factor,
                                   attention=self.attention * factor,
                                   sources=(f"compute rates x {factor:.3f}: {why}",) + self.sources)


def gpu_rates(gpu: GPU, dtype: str = "bf16", matmul: float | None = None) -> Rates:
    """A GPU's rates: datasheet x the measured efficiencies above (float8 matmuls at the float8 datasheet peak x the
    same share), solved from its `calibration` run where it has one, or scaled to the reader's own large-matmul
    FLOP/s (`matmul`)."""
    peak, peak_source = datasheet_flops(gpu.device, dtype)
    ref_peak = datasheet_flops(MEASURED_MATMUL[1], "bf16")[0]
    share = MEASURED_MATMUL[0] / ref_peak
    float8 = hardware_peak(gpu.device, FLOAT8_DTYPE)
    base = Rates(peak * share, gpu.attention_efficiency * peak, MEMORY_EFFICIENCY * gpu.hbm,
                 BUS_EFFICIENCY * gpu.nvlink, BUS_EFFICIENCY * gpu.network, 30e-6, gpu.gpus_per_node, gpu.sms,
                 (f"matmul {peak * share / 1e12:.0f} TFLOP/s: {share:.1%} of the datasheet, as {MEASURED_MATMUL[2]} "
                  f"measured ({peak_source})" + (f"; float8 {float8 * share / 1e12:.0f} TFLOP/s, the same share of "
                                                  f"{float8 / 1e12:.0f}" if float8 else ""),
                  f"attention {gpu.attention_efficiency:.0%} of the datasheet: {ATTENTION_SOURCES}",
                  f"memory {MEMORY_EFFICIENCY:.0%} of {gpu.hbm / 1e12:.2f} TB/s: notebook 01b's copy rate on an H200",
                  f"links {BUS_EFFICIENCY:.0%} of {gpu.nvlink / GB:.0f} GB/s in a node, {gpu.network / GB:.0f} GB/s "
                  f"between nodes: {gpu.source}"), float8 * share)
    if matmul:
        return base.scaled(matmul / base.matmul, f"the reader's measured matmul, {matmul / 1e12:.0f} TFLOP/s")
    if gpu.calibration is not None and dtype != "fp32":
        return base.scaled(calibrate(gpu.calibration, base), f"solved from {gpu.calibration.source}")
    return base


# ------------------------------------------------------------------------------------------------------- 2. model state

def _block_shapes(cfg: LlamaArgs, i: int, experts: int = 0) -> list[tuple[str, tuple[int, ...], int | None]]:
    """Block i's parameters: (name, shape, tensor-parallel shard dim or None); with `experts`, moe.py's MoE in place
    of the feed-forward: a router Linear(dim, experts), each of w1, w3, w2 stacked (experts, out, in)."""
    d, h, hd, p, e = cfg.dim, cfg.hidden, cfg.head_dim, f"layers.{i}.", experts
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    ffn = [(p + "feed_forward.w1.weight", (h, d), 0), (p + "feed_forward.w3.weight", (h, d), 0),
           (p + "feed_forward.w2.weight", (d, h), 1)] if not e else \
        [(p + "feed_forward.router.weight", (e, d), None), (p + "feed_forward.experts.w1.weight", (e, h, d), None),
         (p + "feed_forward.experts.w3.weight", (e, h, d), None), (p + "feed_forward.experts.w2.weight", (e, d, h), None)]
    return [(p + "attention_norm.weight", (d,), None),
            (p + "attention.wq.weight", (q, d), 0), (p + "attention.wk.weight", (kv, d), 0),
            (p + "attention.wv.weight", (kv, d), 0), (p + "attention.wo.weight", (d, q), 1),
            (p + "ffn_norm.weight", (d,), None)] + ffn


def _ends(cfg: LlamaArgs) -> tuple[list, list]:
    """(the first stage's parameters before the blocks, the last stage's after them); a tied output is the
    embedding: one parameter."""
    d, v = cfg.dim, cfg.vocab_size
    return [("tok_embeddings.weight", (v, d), 0)], \
        [("norm.weight", (d,), None)] + ([] if cfg.tie_embeddings else [("output.weight", (v, d), 0)])


def parameter_shapes(cfg: LlamaArgs, experts: int = 0) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(name, shape, tensor-parallel shard dim or None) of every parameter, in the model's order (`experts`: MoE
    feed-forwards, `_block_shapes`).

    The tp dims are the recipe's plan (tp.apply_tp): the embedding row-wise over the vocabulary, wq/wk/wv/w1/w3 and
    the output column-wise (their weight's dim 0), wo/w2 row-wise (dim 1), norms replicated.
    """
    first, last = _ends(cfg)
    return first + [s for i in range(cfg.n_layers) for s in _block_shapes(cfg, i, experts)] + last


def count_parameters(build_model) -> int:
    """Parameters of the real model, built on the meta device (no memory): `build_model()` returns the module."""
    import torch

    with torch.device("meta"):
        return sum(p.numel() for p in build_model().parameters())


def _chunk(n: int, parts: int, index: int) -> int:
    """Length of part `index` when torch.chunk splits n into `parts` (ceil(n/parts) each, fewer or none at the end)."""
    size = -(-n // parts)
    return max(0, min(size, n - index * size))


def coordinates(layout: Layout, rank: int) -> dict[str, int]:
    """{mesh dim: `rank`'s index on it}, tp varying fastest (init_device_mesh's row-major order of MESH_DIMS)."""
    out = {}
    for name in reversed(MESH_DIMS):
        size = getattr(layout, name)
        out[name] = rank % size
        rank //= size
    return out


def layout_name(layout: Layout) -> str:
    return f"dp_replicate={layout.dp_replicate} dp_shard={layout.dp_shard} tp={layout.tp} pp={layout.pp}"


def pipeline_rank_layers(cfg: LlamaArgs, layout: Layout, stage: int, chunks: int = 1) -> tuple[list[int], bool, bool]:
    """(the blocks, whether it holds the embedding, whether the final norm and output) of pipeline rank `stage`:
    one stage of pp, or with `chunks` stages per rank (an interleaved schedule) stages stage, stage + pp, ... of
    pp x chunks, placed in a loop as pipeline.py's "loop" style places them (config.stage_layers splits the layers)."""
    chunks = chunks if layout.pp > 1 else 1
    n = layout.pp * chunks
    stages = [stage + k * layout.pp for k in range(chunks)]
    return [i for s in stages for i in stage_layers(cfg.n_layers, n, s)], 0 in stages, n - 1 in stages


def stage_groups(cfg: LlamaArgs, layout: Layout, stage: int, experts: int = 0, chunks: int = 1
                 ) -> list[tuple[str, list, int]]:
    """Pipeline rank `stage`'s parameters as FSDP2 groups the recipe makes (`fully_shard` per block, the rest in
    the root): (name, its parameters, how many alike), the blocks (`pipeline_rank_layers`: torchtitan's uneven
    split, `chunks` stages per rank) as one template counted, then the root (the embedding with the first stage, the
    final norm and output with the last)."""
    blocks, first_stage, last_stage = pipeline_rank_layers(cfg, layout, stage, chunks)
    first, last = _ends(cfg)
    root = (first if first_stage else []) + (last if last_stage else [])
    groups = [("layers", _block_shapes(cfg, blocks[0], experts), len(blocks))] if len(blocks) else []
    return groups + ([("root", root, 1)] if root else [])


def stage_parameters(cfg: LlamaArgs, layout: Layout, stage: int, chunks: int = 1
                     ) -> list[tuple[str, tuple[int, ...], int | None]]:
    """The parameters of pipeline rank `stage`: the embedding with the first stage, its blocks, the final norm and
    output with the last (dense: MoE is not pipelined)."""
    first, last = _ends(cfg)
    blocks, first_stage, last_stage = pipeline_rank_layers(cfg, layout, stage, chunks)
    return (first if first_stage else []) + [s for i in blocks for s in _block_shapes(cfg, i)] + \
        (last if last_stage else [])


def tp_local_shape(shape: tuple[int, ...], tp_dim: int | None, tp: int, tp_rank: int) -> tuple[int, ...]:
    if tp_dim is None or tp == 1:
        return shape
    return tuple(_chunk(n, tp, tp_rank) if i == tp_dim else n for i, n in enumerate(shape))


def recipe_precision(dtype: str, layout: Layout) -> str:
    """The precision policy the recipe's --dtype gives at a layout: bf16 is FSDP2's policy (bf16 parameters for
    compute, fp32 reduction) where FSDP2 is applied, autocast elsewhere."""
    if dtype == "fp32":
        return "fp32"
    if dtype != "bf16":
        raise ValueError(f"dtype must be fp32 or bf16, not {dtype!r}")
    return "bf16-fsdp" if layout.fsdp else "bf16-autocast"


def _dtype_bytes(precision: str) -> dict[str, int]:
    """Bytes per element of: the stored (master) parameters, their gradients, the compute copy FSDP2 gathers, the
    activations of the residual stream and of the matmul inputs, the gradient reduction."""
    if precision == "fp32":
        return {"param": 4, "grad": 4, "gathered": 4, "residual": 4, "matmul": 4, "reduce": 4}
    if precision == "bf16-autocast":   # fp32 weights and residual stream; autocast casts each matmul's inputs to bf16
        return {"param": 4, "grad": 4, "gathered": 4, "residual": 4, "matmul": 2, "reduce": 4}
    # FSDP2's policy: bf16 parameters for compute (so bf16 activations throughout), fp32 master copy and reduction
    return {"param": 4, "grad": 4, "gathered": 2, "residual": 2, "matmul": 2, "reduce": 4}


def recipe_job(cfg: LlamaArgs, train: Training, layout: Layout) -> Job:
    """The recipe's Job that runs this plan (job.py: its flags from `recipe_flags`, section 7): what it decides of
    the plan is read from it, as train.py reads it (`Job.float8_all_gather`), not decided again here. Made once per
    plan (`_JOBS`: a search asks for it per parameter)."""
    key = (repr(cfg), train, layout)
    if key not in _JOBS:
        _JOBS[key] = Job(**recipe_flags(train, layout), model_config=cfg)
    return _JOBS[key]


_JOBS: dict[tuple, Job] = {}


def float8_converted(name: str, cfg: LlamaArgs, train: Training, tp: int) -> bool:
    """Whether parameter `name` ("layers.3.attention.wq.weight") is the weight of a linear the recipe's float8.py
    converts at this tp (`float8_linear_names`: a block's linears whose piece on a rank has both dimensions a
    multiple of 16); not the output head, the norms, the embedding, nor an MoE's router and experts."""
    parts = name.split(".")
    return bool(train.float8) and parts[0] == "layers" and ".".join(parts[2:-1]) in float8_linear_names(cfg, tp)


def gathered_width(name: str, cfg: LlamaArgs, train: Training, layout: Layout) -> int:
    """Bytes per element FSDP2 all-gathers of parameter `name`: the compute dtype (`_dtype_bytes`), or 1 for a
    float8 weight where the recipe gathers in float8 (`Job.float8_all_gather`: tensorwise where FSDP2 shards; the
    shard is cast before it is sent; rowwise gathers the high-precision weight and casts after)."""
    if train.float8 and recipe_job(cfg, train, layout).float8_all_gather and float8_converted(name, cfg, train,
                                                                                               layout.tp):
        return 1
    return _dtype_bytes(train.precision)["gathered"]


def model_state(cfg: LlamaArgs, train: Training, layout: Layout, rank: int) -> dict:
    """Bytes of parameters, gradients and optimizer state on `rank`, held and allocated (FSDP2 padding included).

    FSDP2 (dp_shard > 1) shards each parameter's dim 0 over dp_shard with torch.chunk (after tp has taken its part:
    a 2-D parameter's local tensor is what FSDP splits): rank k owns chunk k, and every rank's shard lives in a
    buffer of ceil(dim0 / dp_shard) rows (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, `_init_sharded_param`:
    `padded_sharded_size = chunks[0].size()`); the gradient arrives in the same padded layout. The optimizer's state
    is `zeros_like` the unpadded local shard. DDP (dp_shard = 1) holds every parameter of its stage whole.
    Under tensor parallelism without FSDP2 the row-wise embedding's gradient comes back whole on every tp rank
    (DTensor's embedding backward; measured in notebook 10), twice its sharded size at tp = 2; FSDP2's
    reduce-scatter returns it sharded. Buffers (the rotary tables) are not model state: see `rope_tables_bytes`.
    Under expert parallelism (`Training.ep` > 1) each rank holds its experts whole, outside FSDP2 (`expert_elements`).
    """
    c = coordinates(layout, rank)
    b = _dtype_bytes(train.precision)
    shard = layout.dp_shard if layout.fsdp else 1
    held = padded = whole_grads = experts = 0
    for _, params, count in stage_groups(cfg, layout, c["pp"], train.moe_experts, train.chunks):
        for name, shape, tp_dim in params:
            local = tp_local_shape(shape, tp_dim, layout.tp, c["tp"])
            rest = math.prod(local[1:])
            if train.ep > 1 and ".experts." in name:          # Shard(0) over ep: E / ep experts, no FSDP2
                experts += count * local[0] // train.ep * rest
                continue
            held += count * _chunk(local[0], shard, c["dp_shard"]) * rest
            padded += count * -(-local[0] // shard) * rest
            if layout.tp > 1 and not layout.fsdp and name.startswith("tok_embeddings"):
                whole_grads += math.prod(shape) - math.prod(local)
    states, held, padded = OPTIMIZERS[train.optimizer], held + experts, padded + experts
    return {
        "elements": held, "padded_elements": padded, "expert_elements": experts,
        "held": {"parameters": held * b["param"], "gradients": (held + whole_grads) * b["grad"],
                 "optimizer": held * 4 * states},
        "allocated": {"parameters": padded * b["param"], "gradients": (padded + whole_grads) * b["grad"],
                      "optimizer": held * 4 * states},
    }


def rope_tables_bytes(cfg: LlamaArgs) -> int:
    """The rotary tables every stage keeps as buffers: cos and sin, max_seq_len x head_dim / 2 each, float32."""
    return 2 * cfg.max_seq_len * (cfg.head_dim // 2) * 4


# ------------------------------------------------------------------------------------------------------- 3. activations

def rank_tokens(train: Training) -> int:
    """Tokens of one micro-batch on one rank: batch_size sequences, of which each of the cp ranks holds 1/cp."""
    return train.batch_size * train.seq_len // train.cp


def layer_activations(cfg: LlamaArgs, train: Training, tp: int) -> dict[str, float]:
    """Bytes autograd keeps for backward in one transformer block for one micro-batch, by tensor (no checkpointing).

    Korthikanti et al. (2022), "Reducing Activation Recomputation in Large Transformer Models", count
    s*b*h*(34 + 5*a*s/h) bytes per layer in fp16 for a GPT (LayerNorm, a 4h GELU MLP, dropout, stored s^2 scores).
    This Llama has no dropout, RMSNorm, rotary positions, grouped-query attention, a SwiGLU feed-forward, and
    attention by `F.scaled_dot_product_attention`, whose flash kernels keep q, k, v, the output and one log-sum-exp
    per row and head, never the s x s scores; so the terms below, one per saved tensor:
    - the rotation multiplies float32 pairs by cos and sin, which need no gradient: autograd keeps cos and sin
      (slices of the root's buffers; see `rope_activations`), not the pairs, and the rotated q is cast back;
    - grouped-query attention's k and v are repeated (`repeat_interleave`) to every query head before attention,
      which keeps the repeated ones: n_heads x head_dim = dim each, whatever n_kv_heads is;
    - SwiGLU keeps w1's output (silu's input), silu's output and w3's output (the product's inputs), and the product
      (w2's input): four tensors of the hidden width.
    Under tp the recipe's sequence parallelism splits the residual stream along the sequence, but DTensor saves the
    all-gathered (whole) input of every column-wise projection: the two "gathered" terms do not shrink with tp
    (Megatron keeps the shard and gathers again in backward; DTensor does not). Under bf16 autocast the normed input
    is cast to bf16 once per projection it feeds (autocast caches casts of weights, not of activations): three
    copies for wq, wk, wv and two for w1, w3. RMSNorm: on CUDA `rms_norm` is one fused kernel that keeps its input
    and one fp32 rstd per row; torch 2.13 on the CPU composes it of pow, mean, rsqrt and mul on an fp32 copy of its
    input, and keeps that copy and x * rstd, both fp32 (`Training.fused_rms_norm=False`). Context parallelism
    and experts change the attention's and the feed-forward's terms (`ring_activations`, `moe_activations`).
    """
    b = _dtype_bytes(train.precision)
    n = rank_tokens(train)                               # tokens of one micro-batch on this rank
    d, hidden, heads, mat = cfg.dim, cfg.hidden, cfg.n_heads, b["matmul"]
    autocast = train.precision == "bf16-autocast"
    norm_in = b["residual"] if train.fused_rms_norm else 4     # the composite upcasts its input to fp32 first
    terms = {
        "norm inputs (x, h)": 2 * n * d * norm_in / tp,
        "norm rstd": 2 * n * 4 / tp,
        "attention input, gathered (wq, wk, wv)": (3 if autocast else 1) * n * d * mat,
        "q rotated, k and v repeated": 3 * n * d * mat / tp,
        "attention output": n * d * mat / tp,
        "attention log-sum-exp": n * heads * 4 / tp,
        "feed-forward input, gathered (w1, w3)": (2 if autocast else 1) * n * d * mat,
        "SwiGLU: w1 and w3 outputs, silu, product": 4 * n * hidden * mat / tp,
    }
    if not train.fused_rms_norm:
        terms["norm x * rstd (composite RMSNorm, fp32)"] = 2 * n * d * 4 / tp
    if train.cp > 1:
        terms.update(ring_activations(cfg, train))
    if train.moe_experts:                                # the router's input in place of w1's and w3's
        terms["feed-forward input, gathered (w1, w3)"] = n * d * mat
        terms.update(moe_activations(cfg, train))
    return terms


def ring_activations(cfg: LlamaArgs, train: Training) -> dict[str, float]:
    """What cp.py's ring attention keeps in place of SDPA's terms (`layer_activations`), per block and micro-batch:
    RingAttention saves q, k and v at n_kv_heads heads (it repeats k and v per step, unsaved), its output and its
    log-sum-exp (in the compute dtype: the ring computes it, not a fused kernel); wo keeps its input beside the
    output, a copy (the ring's output is laid out by head, and transpose-reshape copies it)."""
    b, n = _dtype_bytes(train.precision), rank_tokens(train)
    kv = cfg.n_kv_heads * cfg.head_dim
    return {"q rotated, k and v repeated": n * (cfg.dim + 2 * kv) * b["matmul"],
            "attention output": 2 * n * cfg.dim * b["matmul"],
            "attention log-sum-exp": n * cfg.n_heads * b["residual"]}


def moe_rows(train: Training) -> int:
    """Rows one rank's experts take per block and micro-batch under even routing: its tokens k times each (with
    ep, the rows it sends away are matched by as many received)."""
    return rank_tokens(train) * train.moe_top_k


def moe_activations(cfg: LlamaArgs, train: Training, rows: int | None = None) -> dict[str, float]:
    """What moe.py's MoE keeps in place of the SwiGLU feed-forward, per block and micro-batch; `rows`: rows this
    rank's experts received (default `moe_rows`, even routing). The router's fp32 probabilities (softmax keeps its
    output); top-k's weights, their sum and indices; the (token, choice) order and the token of each routed row
    (int64, kept by the gathers and index_add_); the chosen weights gathered; each expert's input rows (cast once
    per w1, w3 under autocast) and its SwiGLU (as the dense one, per row); the experts' outputs and the weighted
    ones (index_add_ keeps its source); the aux loss's assignment shares. With ep the received rows are regrouped
    by expert and back (two int64 indices per row); under autocast every expert weight is cast again per forward
    and kept (w1[e] is a view: autocast caches casts of leaf weights only)."""
    b, n, e, k, d = _dtype_bytes(train.precision), rank_tokens(train), train.moe_experts, train.moe_top_k, cfg.dim
    rows = moe_rows(train) if rows is None else rows
    mat, res, autocast = b["matmul"], b["residual"], train.precision == "bf16-autocast"
    terms = {"router probabilities (fp32)": n * e * 4,
             "top-k weights, their sum (fp32), indices": n * k * 4 + n * 4 + n * k * 8,
             "routing order and token of each row (int64)": 2 * n * k * 8,
             "chosen weights, by expert": n * k * res,
             "experts' input rows": (2 if autocast else 1) * rows * d * mat,
             "SwiGLU: w1 and w3 outputs, silu, product": 4 * rows * cfg.hidden * mat,
             "experts' outputs, and weighted": n * k * d * (mat + res),
             "aux loss's assignment shares": e * 4}
    if train.ep > 1:
        terms["rows regrouped by expert and back (int64)"] = 2 * rows * 8
    if autocast:
        terms["expert weights cast to bf16 (not cached)"] = 3 * e // train.ep * d * cfg.hidden * 2
    return terms


def moe_statistics_bytes(train: Training) -> int:
    """What each MoE block holds after a forward on the module, not for autograd: tokens_per_expert (int64) and
    aux_loss (a float32 scalar)."""
    return train.moe_experts * 8 + 4 if train.moe_experts else 0


def head_activations(cfg: LlamaArgs, train: Training, tp: int) -> dict[str, float]:
    """Bytes kept outside the blocks for one micro-batch on the last stage: the final norm's input, the output
    projection's (gathered) input, what the loss keeps (`loss_bytes`) and its int64 targets."""
    b = _dtype_bytes(train.precision)
    n = rank_tokens(train)
    d = cfg.dim
    norm = (n * d * b["residual"] if train.fused_rms_norm else 2 * n * d * 4) / tp
    return {
        "final norm input": norm + n * 4 / tp,
        "output projection input, gathered": n * d * b["matmul"],
        **loss_bytes(cfg, train, tp)["kept"],
        "targets": n * 8,
    }


def loss_bytes(cfg: LlamaArgs, train: Training, tp: int) -> dict:
    """What the loss of one micro-batch keeps for backward ('kept', by tensor) and what its backward adds
    ('backward'). model.py's ChunkedCrossEntropy (tp 1): the logits as they are and a float32 log-sum-exp per token;
    its backward writes the logits' gradient and holds one chunk's float32 softmax (model.LOSS_CHUNK_BYTES: imported
    here, with torch). F.cross_entropy on a float32 copy (`Training.loss` "float32", and the recipe under tp's
    loss_parallel, the vocabulary split by tp): the float32 log-probabilities, and in backward two more float32
    tensors of the vocabulary (the gradient nll_loss hands back, log_softmax's gradient of the logits)."""
    n, v = rank_tokens(train), cfg.vocab_size
    if train.loss == "float32" or tp > 1:
        logprobs = n * v * 4 / tp
        return {"kept": {"log-probabilities (fp32)": logprobs}, "backward": 2 * logprobs}
    from model import LOSS_CHUNK_BYTES

    rows = min(n, max(1, LOSS_CHUNK_BYTES // (4 * v)))
    logits = n * v * _dtype_bytes(train.precision)["matmul"]
    return {"kept": {"logits (the chunked loss keeps them)": logits, "log-sum-exp per token (fp32)": n * 4},
            "backward": logits + rows * v * 4}


def embedding_activations(train: Training) -> dict[str, float]:
    """The token ids the embedding keeps for its backward (int64); Llama has no position embedding."""
    return {"token ids": rank_tokens(train) * 8}


def rope_activations(cfg: LlamaArgs, train: Training, layout: Layout) -> dict[str, float]:
    """What the rotation's cos and sin cost per block and micro-batch: nothing new where the blocks take slices of
    the root's float32 buffers (autograd keeps the buffers' storage, `rope_tables_bytes`, already held); under
    FSDP2's bf16 policy every block's forward casts its floating-point inputs to bf16 (`cast_forward_inputs`), so
    each block keeps its own bf16 copies of the two slices (seq_len x head_dim / 2 each). Under cp, apply_cp
    gathers the tables at this rank's positions for each forward: the blocks keep that float32 copy ("per
    forward", seq_len / cp rows) instead of the buffers, or under FSDP2's policy their bf16 copies of it."""
    rows = train.seq_len // train.cp
    if train.precision == "bf16-fsdp":
        return {"per block": 2 * rows * (cfg.head_dim // 2) * 2.0, "per forward": 0.0, "buffers saved": 0.0}
    if train.cp > 1:
        return {"per block": 0.0, "per forward": 2 * rows * (cfg.head_dim // 2) * 4.0, "buffers saved": 0.0}
    return {"per block": 0.0, "per forward": 0.0, "buffers saved": float(rope_tables_bytes(cfg))}


@functools.lru_cache(maxsize=4096)
def schedule_order(name: str, pp: int, microbatches: int, rank: int, chunks: int = 0) -> tuple[tuple[int, str, int]]:
    """The compute actions pipeline rank `rank` runs in one step, in order: (stage, kind, micro-batch), kind F a
    forward, B a backward, I and W the input's and the weights' halves of a backward the zero-bubble schedule splits.

    As torch.distributed.pipelining's schedules (torch 2.11 to 2.13) run them: GPipe every forward, then every
    backward; 1F1B min(m, pp - rank) forwards, then a backward and a forward in turn, then the backwards left; the
    interleaved schedules (`chunks` stages per rank, default SCHEDULES') as `_get_warmup_ops` and
    `_get_1f1b_rank_ops` order them: (chunks - 1) rounds of forwards plus 2 per rank below the last (1 for
    zero bubble) before the first backward, the forwards in rounds of m / max(1, m // pp) micro-batches per stage,
    the backwards from the last stage back; zero bubble splits each backward into I and W and delays W by `rank`
    steps. tests/planner runs torch's schedules on gloo ranks and holds these orders equal to what they ran."""
    v, m = chunks or SCHEDULES[name], microbatches
    if name == "gpipe":
        return tuple([(rank, "F", i) for i in range(m)] + [(rank, "B", i) for i in range(m)])
    if name == "1f1b":
        warm = min(m, pp - rank)
        order = [(rank, "F", i) for i in range(warm)]
        for i in range(m):
            order += [(rank, "B", i)] + ([(rank, "F", warm + i)] if warm + i < m else [])
        return tuple(order)
    zero_bubble = name == "interleaved-zb"
    per_round = m // max(1, m // pp)
    warm = min((v - 1) * per_round + (1 if zero_bubble else 2) * (pp - 1 - rank), m * v)
    done = {"F": [0] * (v * pp), "B": [0] * (v * pp), "W": [0] * (v * pp)}
    order, backwards = [], []

    def act(stage, kind):
        count = done["B" if kind == "I" else kind]
        order.append((stage, kind, count[stage]))
        count[stage] += 1

    for op in range(m * v + warm):
        if op < m * v:
            act((op // per_round) % v * pp + rank, "F")
        if op >= warm:
            backwards.append((v - 1 - ((op - warm) // per_round) % v) * pp + rank)
            act(backwards[-1], "I" if zero_bubble else "B")
            if zero_bubble and op - warm >= rank:
                act(backwards[sum(done["W"])], "W")
    while zero_bubble and sum(done["W"]) < len(backwards):
        act(backwards[sum(done["W"])], "W")
    return tuple(order)


@functools.lru_cache(maxsize=1024)
def pipeline_bubble(name: str, pp: int, microbatches: int, chunks: int, backward_input: float,
                    backward_weight: float) -> tuple[float, ...]:
    """Each pipeline rank's idle share of a step (1 - its busy time / the step's) with schedule `name`, its order
    replayed on one clock by notebook 08's `replay` (pipeline.py: each action waits for its rank and for what it
    needs) with a forward of 1 and a backward of `backward_input` + `backward_weight` (its input's and weights'
    gradients, in forwards) on every stage alike: 1F1B's is (pp - 1) / (m + pp - 1). pipeline.py imports torch:
    imported here, only where a pipeline is planned."""
    from pipeline import replay

    replayed = replay({r: list(schedule_order(name, pp, microbatches, r, chunks)) for r in range(pp)}, 1.0,
                      backward_input + backward_weight, backward_weight)
    return tuple(1 - replayed["busy"][r] / replayed["makespan"] for r in range(pp))


def in_flight(order: tuple[tuple[int, str, int], ...], weight: dict[int, float] | None = None) -> float:
    """The most a rank holds for backward at once: over its order, the forwards (weighted by their stage's bytes,
    `weight`; 1 each without) whose activations are not yet freed, by the backward (B) or, where the backward is
    split, by its weights' half (W: the weight gradients need the matmuls' saved inputs). Exact for GPipe, 1F1B and
    interleaved 1F1B (tests/planner); under zero bubble torch 2.13 keeps part of a later stage's tensors past W,
    until the step ends: there this count is a floor."""
    split = any(kind == "W" for _, kind, _ in order)
    held = peak = 0.0
    for stage, kind, _ in order:
        w = (weight or {}).get(stage, 1.0)
        held += w if kind == "F" else -w if kind == ("W" if split else "B") else 0.0
        peak = max(peak, held)
    return peak


def selective_block(cfg: LlamaArgs, train: Training, tp: int) -> dict[str, float]:
    """What per-op selective checkpointing keeps of one block: its input, and the outputs of the ops its policy
    must save; everything else (norms, rotations, repeats, silu, the product, adds, autocast's casts) is recomputed.

    The recipe's policy ("selective", ac.py) saves every matmul's output and attention's; torchtitan's
    (`TORCHTITAN_SELECTIVE`: `_save_list` and `_custom_policy` in torchtitan/parallelisms/parallelize_llama.py at
    9dec370, today torchtitan/distributed/activation_checkpoint.py) counts a block's matmuls and recomputes every
    second one (wk, wo, w3 of wq, wk, wv, wo, w1, w3, w2), and saves a reduce-scatter's output (under tp: wo's and
    w2's, sequence-split). Row-wise projections (wo, w2) output a partial sum over the whole sequence before their
    reduce-scatter, so under tp their outputs do not shrink. Eager checkpointing keeps what its policy names even
    where no backward reads it (wo's and w2's outputs feed only the residual adds); torch.compile's partitioner keeps
    only what the backward needs, so a compiled block leaves those out (`Training.compile`). Under cp the ring keeps
    nothing: its ops run inside an autograd.Function's forward, with autograd off, which the policy recomputes (its
    score blocks, chunk x chunk per head, would be quadratic in seq_len / cp); an MoE keeps its router's logits,
    and its experts' w1, w3 and w2 outputs per routed row.
    """
    b = _dtype_bytes(train.precision)
    n = rank_tokens(train)
    rows = moe_rows(train) if train.moe_experts else n            # the feed-forward's matmul rows
    d, hidden, kv, mat = cfg.dim, cfg.hidden, cfg.n_kv_heads * cfg.head_dim, b["matmul"]
    titan = train.checkpointing == TORCHTITAN_SELECTIVE
    attention = 0.0 if train.cp > 1 else n * d * mat / tp + n * cfg.n_heads * 4 / tp
    terms = {"block input": n * d * b["residual"] / tp,
             "wq output": n * d * mat / tp,
             "wk output": 0.0 if titan else n * kv * mat / tp,
             "wv output": n * kv * mat / tp,
             "attention output and log-sum-exp": attention,
             "router logits": n * train.moe_experts * mat,
             "w1 output": rows * hidden * mat / tp,
             "w3 output": 0.0 if titan else rows * hidden * mat / tp}
    unread = {"wo output (partial sum)": 0.0 if titan else n * d * mat, "w2 output (partial sum)": rows * d * mat}
    if titan and tp > 1:
        unread["wo and w2 outputs, reduce-scattered"] = 2 * n * d * mat / tp
    if not train.compile:
        terms.update(unread)
    return {k: v for k, v in terms.items() if v}


def checkpointed_blocks(cfg: LlamaArgs, train: Training, blocks: list[int]) -> list[int]:
    """The blocks whose forward runs under torch.utils.checkpoint: all of them ("full", "selective"), the even ones
    ("alternate", as ac.apply_ac skips the odd), none."""
    if train.checkpointing == "none":
        return []
    if train.checkpointing == "alternate":
        return [i for i in blocks if i % 2 == 0]
    return list(blocks)


def activations(cfg: LlamaArgs, train: Training, layout: Layout, rank: int) -> dict:
    """Activation bytes a rank keeps at its peak (the end of a forward, before the backward frees them), by term.

    Checkpointing, as the recipe's --ac: "full" keeps each block's input only (the residual stream,
    sequence-split under tp) and recomputes one block at a time in backward, so one block's activations come back
    at once ("recompute"); "selective" (and torchtitan's policy) keeps what `selective_block` lists; "alternate"
    checkpoints every other block whole and keeps everything of the others. (Korthikanti's selective recomputation
    recomputes the s^2 attention scores only; flash attention never stores them, so here it would save nothing.)

    Under bf16 autocast the bf16 copies of the stage's matmul weights (`autocast_weight_copies`) are kept once,
    whatever the checkpointing: autocast caches each cast of a weight until its context exits, and the recipe's
    context spans the forward and the backward (a pipeline's, the whole step). "kept" is the micro-batches in
    flight (the schedule's order, `in_flight`, each stage's forward weighted by its bytes) plus that cache;
    "per_microbatch" is one forward through all the rank's stages, the cache left out; "buffers_saved" is the
    rotary tables' storage autograd also keeps, a buffer the stage holds anyway (in no "kept").
    """
    c = coordinates(layout, rank)
    tp, stage = layout.tp, c["pp"]
    blocks, first, last = pipeline_rank_layers(cfg, layout, stage, train.chunks)
    casts = autocast_weight_copies(cfg, train, layout, rank)
    layer = layer_activations(cfg, train, tp)
    one = sum(layer.values())
    rope = rope_activations(cfg, train, layout)
    n = rank_tokens(train)
    kept_input = n * cfg.dim * _dtype_bytes(train.precision)["residual"] / tp
    if train.checkpointing in ("selective", TORCHTITAN_SELECTIVE):
        kept = selective_block(cfg, train, tp)
        per_checkpointed = sum(kept.values())
        reused = layer["attention output"] + layer["attention log-sum-exp"] + \
            layer["SwiGLU: w1 and w3 outputs, silu, product"] / 4 * (1 if "w3 output" not in kept else 2)
        recompute = one - reused
    else:
        per_checkpointed, recompute = kept_input, one

    def forward_terms(blocks: list[int], first: bool, last: bool) -> dict[str, float]:
        """What one micro-batch's forward through these blocks (and the ends they hold) keeps."""
        checkpointed = len(checkpointed_blocks(cfg, train, blocks))
        terms = {"blocks": (len(blocks) - checkpointed) * one + checkpointed * per_checkpointed
                 + len(blocks) * (rope["per block"] + moe_statistics_bytes(train)) + rope["per forward"]}
        if first:
            terms["embedding"] = sum(embedding_activations(train).values())
        if last:
            terms["head"] = sum(head_activations(cfg, train, tp).values())
        return terms

    terms = forward_terms(blocks, first, last)
    per_micro = sum(terms.values())
    flight, micro = per_micro, 1
    if layout.pp > 1:
        stages, order = layout.pp * train.chunks, schedule_order(train.pp_schedule, layout.pp, train.grad_accum,
                                                                 stage, train.chunks)
        weight = {s: sum(forward_terms(list(stage_layers(cfg.n_layers, stages, s)), s == 0, s == stages - 1).values())
                  for s in {a[0] for a in order}}
        flight, micro = in_flight(order, weight), int(in_flight(order))
    cache = casts["block"] * len(blocks) + casts["head"]
    return {"per_microbatch": per_micro, "in_flight": micro, "autocast_cache": cache, "kept": flight + cache,
            "recompute": recompute if checkpointed_blocks(cfg, train, blocks) else 0.0, "terms": terms,
            "buffers_saved": rope["buffers saved"] if blocks else 0.0}


def autocast_weight_copies(cfg: LlamaArgs, train: Training, layout: Layout, rank: int) -> dict[str, float]:
    """bf16 copies of the matmul weights that autocast makes in forward and caches until its context exits (2 bytes
    each, the rank's tp shard): {"block": one block's, "head": the output projection's on the last stage}. (The
    recipe autocasts only where FSDP2 is not applied, so these are whole local weights.) An MoE's router is
    cached; its experts, cast per forward from views, are not (`moe_activations`)."""
    if train.precision != "bf16-autocast":
        return {"block": 0.0, "head": 0.0}
    c = coordinates(layout, rank)
    d, hidden, kv, tp = cfg.dim, cfg.hidden, cfg.n_kv_heads * cfg.head_dim, layout.tp
    head = 2 * cfg.vocab_size * d / tp if c["pp"] == layout.pp - 1 else 0.0
    ffn = train.moe_experts * d if train.moe_experts else 3 * d * hidden
    return {"block": 2 * (2 * d * d + 2 * d * kv + ffn) / tp, "head": head}


# ------------------------------------------------------------------------------------------ 4. the memory a GPU reports

# The caching allocator reserves more than it hands out: it keeps freed blocks for reuse, rounds requests up, and a
# request that fits no cached block takes a new segment. The model here: reserved = allocated x (1 + overhead), the
# overhead read off runs that published both figures: torchtitan PR #165 (FSDP2, Llama on 8 H100s, local batch 8,
# sequence 2048, eager) logged 23.92 % of 95.0396 GiB peak active and 32.64 % peak reserved with full
# checkpointing, 52.13 % and 62.51 % with per-op selective checkpointing. Full checkpointing's is used for "full",
# the selective one for every other mode (no run published the others). One number per mode, from one run: a
# stated model, not a law; notebook 10 prints a GPU's own ratio where it runs on one.
ALLOCATOR_RUNS = {"full": (23.92, 32.64), "selective": (52.13, 62.51)}   # (peak active %, peak reserved %)
ALLOCATOR_SOURCE = "torchtitan PR #165 (pytorch/torchtitan#165): FSDP2 on 8 H100s, peak active vs peak reserved"
NON_TORCH_BYTES = 2 * GIB   # CUDA's context and NCCL's buffers, outside the caching allocator: kept free on a GPU


def allocator_overhead(checkpointing: str) -> float:
    active, reserved = ALLOCATOR_RUNS["full" if checkpointing == "full" else "selective"]
    return reserved / active - 1


def ring_backward_buffers(cfg: LlamaArgs, train: Training) -> float:
    """What RingAttention's backward holds besides the saved tensors, counted from cp.py (not measured): the
    travelling k, v with their gradients, the copy sent and the one received (12 tensors of one rank's k); k, v
    repeated to every head and their gradients, and dq (5 of the tokens x dim); two score blocks (p, ds)."""
    mat, n, c = _dtype_bytes(train.precision)["matmul"], rank_tokens(train), train.seq_len // (2 * train.cp)
    return (12 * n * cfg.n_kv_heads * cfg.head_dim + 5 * n * cfg.dim
            + 2 * train.batch_size * cfg.n_heads * c * c) * mat


def cp_allgather_buffers(cfg: LlamaArgs, train: Training, tp: int) -> float:
    """What torch's all-gather context parallel holds in a block's backward besides the saved tensors: the keys and
    values of the whole sequence gathered (repeated to every head, the rank's tp share of the heads), the query's
    gradient accumulated in fp32, and the key and value gradients it passes on and receives, in fp32."""
    mat, n = _dtype_bytes(train.precision)["matmul"], rank_tokens(train)
    return (2 * train.cp * n * cfg.dim * mat + (1 + 4) * n * cfg.dim * 4) / tp


def memory(cfg: LlamaArgs, train: Training, layout: Layout, rank: int) -> dict:
    """What `rank` holds at its peak, as the CUDA caching allocator counts it ("allocated", by phase of the step,
    the largest taken) and reserves it ("reserved": `allocator_overhead`).

    Always held: parameters and optimizer state (allocated, FSDP2's padding in), the rotary tables, DDP's gradient
    buckets, a pipelined stage's gathered parameters and unsharded gradients (in the parameters' compute dtype:
    torch's PipelineStage turns FSDP2's reshard_after_backward off until the last micro-batch, and FSDP2 upcasts to
    the reduction's dtype only where it reshards: `to_accumulated_grad_if_needed`); the sharded gradients from the
    second micro-batch on (the recipe frees them at every step's end: set_to_none); a pipeline stage's receive
    buffers, one per micro-batch for the hidden states it receives (all but the first stage) and one for their
    gradients (all but the last), made once by torch's PipelineStage (`_setup_forward_recv_info`). Gathered float8
    weights (tensorwise, FSDP2's float8 all-gather) take 1 byte each. Then the largest of:
    - the loss's backward (last stage): every kept activation and what the loss's backward adds (`loss_bytes`:
      the logits' gradient and one chunk's float32 softmax, or beside a float32 copy's log-probabilities two more
      float32 tensors of the vocabulary);
    - a block's backward: the kept activations, the block recomputed (when checkpointed), two blocks' gathered
      parameters (FSDP2 prefetches one ahead), and the block's gradients in the compute dtype beside their fp32
      copy for the reduce-scatter;
    - the optimizer step: every gradient, and for AdamW (foreach, the default on GPUs) one fp32 temporary per
      parameter (the square root of the second moment).
    Under cp a block's backward also holds the ring's buffers (`ring_backward_buffers`); experts under ep are not
    gathered (each rank holds its own whole).
    """
    c = coordinates(layout, rank)
    last, tp = pipeline_rank_layers(cfg, layout, c["pp"], train.chunks)[2], layout.tp
    b = _dtype_bytes(train.precision)
    state = model_state(cfg, train, layout, rank)
    act = activations(cfg, train, layout, rank)
    n = rank_tokens(train)
    held = {"parameters": state["allocated"]["parameters"], "optimizer": state["allocated"]["optimizer"],
            "rotary tables": rope_tables_bytes(cfg)}
    if layout.ddp:
        held["DDP gradient buckets"] = state["held"]["gradients"]
    shapes = [(name, math.prod(tp_local_shape(s, d, layout.tp, c["tp"]))) for name, s, d in
              _block_shapes(cfg, 0, train.moe_experts) if train.ep == 1 or ".experts." not in name]
    gathered = sum(e for _, e in shapes)
    gathered_bytes = sum(e * gathered_width(name, cfg, train, layout) for name, e in shapes)
    if layout.pp > 1:
        stages = layout.pp * train.chunks
        ways = sum((s > 0) + (s < stages - 1) for s in range(c["pp"], stages, layout.pp))
        held["pipeline receive buffers"] = ways * train.grad_accum * n * cfg.dim * b["residual"] / tp
    if layout.fsdp and layout.pp > 1:
        whole = state["padded_elements"] * layout.dp_shard
        held["FSDP gathered parameters (whole stage)"] = whole * gathered_bytes / gathered
        held["FSDP unsharded gradients (whole stage)"] = whole * b["gathered"]
    grads = state["allocated"]["gradients"] if train.grad_accum > 1 or layout.pp > 1 else 0.0
    loss = loss_bytes(cfg, train, tp) if last else {"kept": {}, "backward": 0.0}
    block = 2 * gathered_bytes + gathered * (b["matmul"] + b["reduce"]) if layout.fsdp and layout.pp == 1 else 0.0
    ring = 0.0 if train.cp == 1 else ring_backward_buffers(cfg, train) if train.cp_attention == "ring" else \
        cp_allgather_buffers(cfg, train, tp)
    phases = {"a block's backward": grads + act["kept"] - sum(loss["kept"].values()) + act["recompute"] + block + ring,
              "optimizer step": state["allocated"]["gradients"]
              + (4 * state["elements"] if train.optimizer == "adamw" else 0)}
    if last:
        phases["the loss's backward"] = grads + act["kept"] + loss["backward"]
    phase = max(phases, key=phases.get)
    allocated = sum(held.values()) + phases[phase]
    return {"allocated": allocated, "reserved": allocated * (1 + allocator_overhead(train.checkpointing)),
            "phase": phase, "held": held, "phases": phases, "activations": act, "state": state}


# ----------------------------------------------------------------------------------------------------- 5. communication

def _group_elements(cfg: LlamaArgs, layout: Layout, rank: int, train: Training) -> list[tuple[int, int, int]]:
    """[(elements of one rank's padded shard of an FSDP group, the bytes FSDP2 gathers of it (`gathered_width`), how
    many such groups)] on `rank`'s pipeline rank: a block (counted), the root (the all-gather output is dp_shard x
    this; the reduce-scatter input too). Experts under ep are no FSDP2 parameters."""
    c, out = coordinates(layout, rank), []
    for _, params, count in stage_groups(cfg, layout, c["pp"], train.moe_experts, train.chunks):
        shards = [(name, -(-s[0] // layout.dp_shard) * math.prod(s[1:])) for name, s in
                  ((name, tp_local_shape(shape, d, layout.tp, c["tp"])) for name, shape, d in params
                   if train.ep == 1 or ".experts." not in name)]
        out.append((sum(e for _, e in shards), sum(e * gathered_width(name, cfg, train, layout) for name, e in shards),
                    count))
    return out


def _ring_factor(kind: str, n: int) -> float:
    """nccl-tests' bus factor: the share of a collective's buffer each rank sends on a ring."""
    if n <= 1:
        return 0.0
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "send": 1.0, "all_to_all": (n - 1) / n}[kind]


def _collective(what: str, kind: str, group: str, size: int, calls: int, nbytes: float, dtype_bytes: int) -> list:
    """The record of one (what, kind, group) of `communication`; none where the group has one rank or no call."""
    if size <= 1 or not calls:
        return []
    return [{"what": what, "kind": kind, "group": group, "group_size": size, "calls": calls, "buffer_bytes": nbytes,
             "dtype_bytes": dtype_bytes, "sent_bytes": nbytes * _ring_factor(kind, size)}]


def _data_parallel_collectives(cfg: LlamaArgs, train: Training, layout: Layout, rank: int) -> list[dict]:
    """FSDP2's all-gathers and reduce-scatters per group (each block, the root), HSDP's all-reduce of the reduced
    shard, or DDP's one all-reduce of every gradient per step (see `communication`)."""
    b = _dtype_bytes(train.precision)
    micro = train.grad_accum
    if layout.fsdp:
        shard, groups = layout.dp_shard, _group_elements(cfg, layout, rank, train)
        gathers, reduces = (1, 1) if layout.pp > 1 else (2 * micro, micro)
        elements, count = sum(e * n for e, _, n in groups), sum(n for _, _, n in groups)
        gathered = sum(g * n for _, g, n in groups)
        return (_collective("FSDP parameters", "all_gather", "dp_shard", shard, gathers * count,
                            gathers * gathered * shard, b["gathered"])
                + _collective("FSDP gradients", "reduce_scatter", "dp_shard", shard, reduces * count,
                              reduces * elements * shard * b["reduce"], b["reduce"])
                + _collective("HSDP gradients", "all_reduce", "dp_replicate", layout.dp_replicate,
                              reduces * count, reduces * elements * b["reduce"], b["reduce"]))
    if layout.ddp:
        return _collective("DDP gradients", "all_reduce", "dp_replicate", layout.dp_replicate, 1,
                           model_state(cfg, train, layout, rank)["held"]["gradients"], 4)
    return []


def _tensor_parallel_collectives(cfg: LlamaArgs, train: Training, layout: Layout, stage: int) -> list[dict]:
    """Sequence parallelism's all-gathers and reduce-scatters per micro-batch (each block's two halves, the
    embedding on the first stage, the output projection on the last), grouped by element width, those a
    checkpointed block's recomputation repeats, and the parallel loss's all-reduces (see `communication`). Under
    float8 a block's all-gathers carry float8 (torchao's float8 tensor parallel styles: the column-wise layers'
    inputs cast before they are gathered, the row-wise layers' output gradients too); its reduce-scatters do not."""
    b = _dtype_bytes(train.precision)
    micro, t = train.grad_accum, layout.tp
    n, d = rank_tokens(train), cfg.dim
    blocks, first, last = pipeline_rank_layers(cfg, layout, stage, train.chunks)
    res, mat = b["residual"], b["matmul"]
    gathered_res, gathered_mat = (1, 1) if train.float8 else (res, mat)
    # (elements, dtype bytes) per micro-batch, forward and backward together
    gathers = [(n * d, gathered_res)] * (2 * len(blocks)) + [(n * d, gathered_mat)] * (2 * len(blocks))
    scatters = [(n * d, mat)] * (2 * len(blocks)) + [(n * d, res)] * (2 * len(blocks))
    if first:
        scatters.append((n * d, res))
        gathers.append((n * d, res))
    if last:
        gathers.append((n * d, res))
        scatters.append((n * d, res))
    records = []
    for what, g, s in (("TP sequence parallel", gathers, scatters), ("TP recomputed by checkpointing", *_recomputed(
            cfg, train, blocks, n * d, gathered_res, mat))):
        by_width: dict = {}
        for kind, items in (("all_gather", g), ("reduce_scatter", s)):
            for elements, width in items:
                calls, nbytes = by_width.get((kind, width), (0, 0))
                by_width[(kind, width)] = (calls + 1, nbytes + elements * width)
        for (kind, width), (calls, nbytes) in sorted(by_width.items()):
            records += _collective(f"{what} ({width}-byte elements)", kind, "tp", t, micro * calls, micro * nbytes,
                                   width)
    if last:
        records += _collective("TP parallel loss", "all_reduce", "tp", t, 3 * micro, 3 * micro * n * 4, 4)
    return records


def _recomputed(cfg: LlamaArgs, train: Training, blocks: list[int], elements: int, res: int, mat: int):
    """(gathers, scatters) a checkpointed block's recomputed forward repeats: both halves' all-gathers, and the
    reduce-scatters unless the policy keeps their outputs (torchtitan's does)."""
    again = len(checkpointed_blocks(cfg, train, blocks))
    scatters = [] if train.checkpointing == TORCHTITAN_SELECTIVE else [(elements, mat)] * (2 * again)
    return [(elements, res)] * (2 * again), scatters


def ring_sends(cfg: LlamaArgs, train: Training, layout: Layout, rank: int) -> list[dict]:
    """cp.py's ring per block and micro-batch, as RingAttention sends it (batch_isend_irecv: each rank sends one
    message to the next and receives one per tensor): forward, cp - 1 shifts of this rank's k and v stacked;
    backward, cp - 1 shifts of k, v and, beside them, of dk, dv in float32 (the ring's statistics' dtype), and a
    last one of dk, dv home; a checkpointed block's recomputed forward, its cp - 1 again. Keys and values travel at
    n_kv_heads heads. The forward's shifts overlap its block compute (started
    before, waited after); the backward waits on each shift at once (`step_time` counts those exposed)."""
    blocks = list(stage_layers(cfg.n_layers, layout.pp, coordinates(layout, rank)["pp"]))
    mat, cp, micro = _dtype_bytes(train.precision)["matmul"], train.cp, train.grad_accum
    elements = rank_tokens(train) * cfg.n_kv_heads * cfg.head_dim     # one rank's k (or v)
    kv, grads = elements * mat, elements * 4
    again = len(checkpointed_blocks(cfg, train, blocks))
    return (_collective("context-parallel ring, forward (k, v)", "send", "cp", cp, micro * len(blocks) * (cp - 1),
                        micro * len(blocks) * (cp - 1) * 2 * kv, mat)
            + _collective("context-parallel ring, recomputed forward", "send", "cp", cp, micro * again * (cp - 1),
                          micro * again * (cp - 1) * 2 * kv, mat)
            + _collective("context-parallel ring, backward (k, v)", "send", "cp", cp, micro * len(blocks) * (cp - 1),
                          micro * len(blocks) * (cp - 1) * 2 * kv, mat)
            + _collective("context-parallel ring, backward (dk, dv in float32)", "send", "cp", cp,
                          micro * len(blocks) * cp, micro * len(blocks) * cp * 2 * grads, 4))


def cp_allgather_collectives(cfg: LlamaArgs, train: Training, layout: Layout, rank: int) -> list[dict]:
    """torch's context_parallel as torchtitan runs it (`Training.cp_attention` "allgather"), per block and micro-batch:
    the forward all-gathers every cp rank's keys and values (repeated to every query head before attention, split
    over tp by head); the backward all-gathers them again and passes each rank's key and value gradients around
    the cp ranks (cp shifts, all-to-all); a checkpointed block's recomputed forward gathers again."""
    blocks = pipeline_rank_layers(cfg, layout, coordinates(layout, rank)["pp"], train.chunks)[0]
    mat, cp, micro = _dtype_bytes(train.precision)["matmul"], train.cp, train.grad_accum
    kv = 2 * rank_tokens(train) * cfg.dim * mat / layout.tp           # one rank's k and v, bytes
    gathers = micro * (2 * len(blocks) + len(checkpointed_blocks(cfg, train, blocks)))
    return (_collective("context-parallel keys and values (all-gather)", "all_gather", "cp", cp, gathers,
                        gathers * cp * kv, mat)
            + _collective("context-parallel key and value gradients (shifts)", "all_to_all", "cp", cp,
                          micro * len(blocks) * cp, micro * len(blocks) * cp * kv, mat))


def expert_collectives(cfg: LlamaArgs, train: Training, layout: Layout, rank: int,
                       rows: list[int] | None = None) -> list[dict]:
    """moe.py's expert_parallel per MoE block and micro-batch, as its all_to_all_single calls carry them (the input
    buffer: what leaves a rank is (ep - 1) / ep of it under even routing): forward, the int64 counts per expert, the
    dispatch of this rank's n x k routed rows (the block's input dtype) and the combine of the rows its experts
    took (their output dtype); backward, the combine's gradient (n x k rows) and the dispatch's (the rows taken);
    a checkpointed block's recomputed forward all three again. `rows`: the rows this rank's experts took in each
    block of its stage (default `moe_rows` each: even routing). Then, once per step, each expert tensor's gradient
    all-reduced over the dp / ep ranks that hold the same experts (one call per tensor)."""
    b, ep, micro, d = _dtype_bytes(train.precision), train.ep, train.grad_accum, cfg.dim
    blocks = list(stage_layers(cfg.n_layers, layout.pp, coordinates(layout, rank)["pp"]))
    rows = dict(zip(blocks, rows or [moe_rows(train)] * len(blocks)))
    redone = checkpointed_blocks(cfg, train, blocks)
    taken, taken_again = micro * sum(rows.values()), micro * sum(rows[i] for i in redone)
    fwd, again, mine = micro * len(blocks), micro * len(redone), moe_rows(train)
    res, mat = b["residual"], b["matmul"]
    experts = model_state(cfg, train, layout, rank)["expert_elements"]
    return (_collective("expert all-to-all, counts (int64)", "all_to_all", "ep", ep, fwd + again,
                        (fwd + again) * train.moe_experts * 8, 8)
            + _collective("expert all-to-all, dispatch and its gradient", "all_to_all", "ep", ep, 2 * fwd + again,
                          ((fwd + again) * mine + taken) * d * res, res)
            + _collective("expert all-to-all, combine and its gradient", "all_to_all", "ep", ep, 2 * fwd + again,
                          (taken + taken_again + fwd * mine) * d * mat, mat)
            + _collective("expert gradients (replicas)", "all_reduce", "ep_replicas", layout.dp // ep,
                          3 * len(blocks), experts * b["reduce"], b["reduce"]))


def communication(cfg: LlamaArgs, train: Training, layout: Layout, rank: int = 0) -> list[dict]:
    """The collectives `rank` takes part in during one step of the recipe, one record per (what, kind, group):
    calls, buffer bytes (the collective's logical buffer summed over calls: an all-gather's output, a
    reduce-scatter's input, an all-reduce's tensor, a point-to-point message) and bytes this rank sends on a ring.

    FSDP2 (the recipe shards with reshard_after_forward=True and reduces every micro-batch): per micro-batch and
    group (each block, the root), one all-gather in forward and one in backward, one reduce-scatter, and across
    dp_replicate (HSDP) one all-reduce of the reduced shard. Under pipelining a stage's parameters stay gathered
    and its gradients unreduced through the step: one all-gather and one reduction per group per step. DDP
    all-reduces every gradient once per step (no_sync on the other micro-batches). Tensor parallelism with
    sequence parallelism, per micro-batch: each block all-gathers the normed input before attention and before the
    feed-forward and reduce-scatters both outputs, and backward does the reverse (a checkpointed block's recomputed
    forward gathers and scatters again); the embedding reduce-scatters its lookups and gathers the gradient back;
    the output projection gathers its input and reduce-scatters its gradient; the parallel loss all-reduces three
    fp32 values per token (max, sum of exponentials, target logit). Clipping all-reduces the per-tensor norms of
    DTensor gradients over each sharded mesh dimension, or a stage's squared norm over the pipeline. The pipeline
    sends each micro-batch's hidden states forward and their gradients back across each stage boundary.
    Context parallelism's ring (`ring_sends`) and expert parallelism's all-to-alls and expert gradients
    (`expert_collectives`, with the experts' norms all-reduced over ep) come on top.
    Not planned: under tp the norm weights' gradients stay partial sums and are all-reduced (dim elements each)
    wherever they are read; notebook 10 counts them.
    """
    stage = coordinates(layout, rank)["pp"]
    records = _data_parallel_collectives(cfg, train, layout, rank)
    if layout.tp > 1:
        records += _tensor_parallel_collectives(cfg, train, layout, stage)
    if train.cp > 1:
        records += (ring_sends if train.cp_attention == "ring" else cp_allgather_collectives)(cfg, train, layout,
                                                                                            rank)
    if train.ep > 1:
        records += expert_collectives(cfg, train, layout, rank)
    sharded_dims = [(g, size) for g, size in (("dp_shard", layout.dp_shard if layout.fsdp else 1), ("tp", layout.tp))
                    if size > 1]
    params = [name for _, group, count in stage_groups(cfg, layout, stage, train.moe_experts, train.chunks)
              for name, _, _ in group for _ in range(count)]
    experts = sum(".experts." in name for name in params) if train.ep > 1 else 0
    for group, size in sharded_dims:
        records += _collective("gradient norm (per-tensor norms)", "all_reduce", group, size, 1,
                               (len(params) - experts) * 4, 4)
    records += _collective("gradient norm (experts' norms)", "all_reduce", "ep", train.ep, 1, experts * 4, 4)
    if train.float8 and recipe_job(cfg, train, layout).float8_all_gather:     # float8.precompute_scales, a step
        converted = sum(float8_converted(name, cfg, train, layout.tp) for name in params)
        records += _collective("float8 weight scales (amax)", "all_reduce", "dp_shard", layout.dp_shard, 1,
                               converted * 4, 4)
    if layout.pp > 1:
        records += _collective("gradient norm (stages' squared norms)", "all_reduce", "pp", layout.pp, 1, 4, 4)
        b = _dtype_bytes(train.precision)
        msg = rank_tokens(train) * cfg.dim * b["residual"] / layout.tp
        stages = layout.pp * train.chunks
        sends = sum((s < stages - 1) + (s > 0) for s in range(stage, stages, layout.pp))
        records += _collective("pipeline hidden states and their gradients", "send", "pp", layout.pp,
                               train.grad_accum * sends, train.grad_accum * sends * msg, b["residual"])
    return records


# -------------------------------------------------------------------------------------------------------------- 6. time

def _tile_fill(m: int, n: int, sms: int) -> float:
    """The share of a GPU's tensor cores an (m x n) output keeps busy: 128 x 256 tiles (cuBLAS's for large bf16
    matmuls), padded at the edges, run in waves of one tile per SM, the last wave part-empty. 1 without SMs (CPU)."""
    if not sms:
        return 1.0
    rows, cols = -(-m // 128), -(-n // 256)
    waves = -(-rows * cols // sms)
    return m * n / (rows * 128 * cols * 256) * rows * cols / (waves * sms)


def matmul_seconds(m: int, k: int, n: int, rates: Rates, float8: bool = False) -> float:
    """(m x k) @ (k x n) at the measured rate of a large square matmul (8192^3) in the compute dtype, or in float8
    (`Rates.float8`), scaled by how well this shape fills the GPU against how well the measured one did
    (`_tile_fill`): matmul efficiency by shape."""
    rate = rates.float8 if float8 else rates.matmul
    return 2 * m * k * n / (rate * _tile_fill(m, n, rates.sms) / _tile_fill(8192, 8192, rates.sms))


def _block_matmuls(cfg: LlamaArgs, n: int, tp: int) -> dict[str, tuple[int, int, int]]:
    """(tokens, in, out) of each projection of a block on one rank: column-wise ones split their outputs,
    row-wise ones their inputs."""
    d, h, q, kv = cfg.dim, cfg.hidden, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return {"wq": (n, d, q // tp), "wk": (n, d, kv // tp), "wv": (n, d, kv // tp), "wo": (n, q // tp, d),
            "w1": (n, d, h // tp), "w3": (n, d, h // tp), "w2": (n, h // tp, d)}


def _forward_backward(m: int, k: int, n: int, rates: Rates, float8: bool = False) -> float:
    """A projection's forward and its backward's two matmuls (the input's gradient, the weight's)."""
    return sum(_passes(m, k, n, rates, float8))


def _passes(m: int, k: int, n: int, rates: Rates, float8: bool = False) -> tuple[float, float, float]:
    """(forward, the input's gradient, the weight's gradient) seconds of one projection's three matmuls."""
    return (matmul_seconds(m, k, n, rates, float8), matmul_seconds(m, n, k, rates, float8),
            matmul_seconds(k, m, n, rates, float8))


def elementwise_bytes(cfg: LlamaArgs, train: Training, tp: int) -> float:
    """Bytes one block's forward reads and writes outside its matmuls and attention, per token on one rank: what
    memory bandwidth, not FLOP/s, bounds. Eager, one kernel per op: two fused RMSNorms, autocast's casts of the
    normed input (five), the rotation in float32 (a copy up, four multiplies and two adds on the halves, the
    stack, the cast back), the repeat of k and v to every query head, two residual adds, silu and the product.
    Compiled (`Training.compile`), each run of elementwise ops between two matmuls is one kernel that reads its
    inputs and writes its outputs once: add and norm, rotation and repeat, silu and product. An MoE runs silu and
    the product on k rows per token, and gathers, weighs and adds back k rows of dim (about four passes each)."""
    b = _dtype_bytes(train.precision)
    r, m = b["residual"], b["matmul"]
    d, h, kv = cfg.dim, cfg.hidden, cfg.n_kv_heads * cfg.head_dim
    repeat = cfg.n_kv_heads < cfg.n_heads
    if train.compile:
        total = 2 * 2 * (r + m) * d + m * (d + 2 * kv) + m * (3 * d if repeat else d + 2 * kv) + 3 * m * h
    else:
        rotate = 36 + (0 if m == 4 else 2 * (m + 4))
        total = (2 * 2 * r * d + (5 * (4 + m) * d if train.precision == "bf16-autocast" else 0) + rotate * (d + kv)
                 + (2 * m * (kv + d) if repeat else 0) + 2 * (2 * r + m) * d + 5 * m * h)
    if train.moe_experts:
        total += (3 if train.compile else 5) * m * h * (train.moe_top_k - 1) + 4 * train.moe_top_k * r * d
    return total / tp


# Bytes per element a float8 cast moves (torchao's dynamic scaling at the versions torchtitan's benchmark names):
# eager, one kernel per op: abs (read 2, write 2), max (read 2), the scale's multiply (2 + 2), the clamp (2 + 2),
# the cast (2 + 1), and the copy the weight gradient's matmul needs in the other layout (1 + 1): 19; compiled, the
# amax rides in the kernel that made the tensor, one kernel reads it once and writes both float8 layouts: 4.
FLOAT8_CAST_BYTES = {"eager": 19, "compiled": 4}


def float8_block_linears(cfg: LlamaArgs, train: Training, tp: int) -> set[str]:
    """The block projections (`_block_matmuls`' names: wq, ..., w2) that run in float8 at this tp: float8.py's
    `float8_linear_names`, none without float8 or where an MoE's experts replace the feed-forward."""
    if not train.float8:
        return set()
    return {name.split(".")[1] for name in float8_linear_names(cfg, tp)
            if not (train.moe_experts and name.startswith("feed_forward"))}


def float8_cast_bytes(cfg: LlamaArgs, train: Training, tp: int) -> tuple[float, float]:
    """(forward, backward) bytes per token on one rank that one block's float8 casts move: every converted matmul's
    input in forward (compiled, one cast per distinct tensor: wq, wk, wv share theirs, w1 and w3 theirs; under tp
    the gathered inputs are cast before they are gathered, a 1/tp share each), every output's gradient in backward
    (FLOAT8_CAST_BYTES each element). Weights are cast once per gather (`step_time`)."""
    converted = float8_block_linears(cfg, train, tp)
    if not converted:
        return 0.0, 0.0
    shapes = _block_matmuls(cfg, 1, tp)            # (1 token, in, out) of each projection on one rank
    gathered = {w: BLOCK_LINEARS[name] == "col" for name in BLOCK_LINEARS for w in [name.split(".")[1]]}
    inputs = {w: shapes[w][1] / (tp if gathered[w] else 1) for w in converted}
    if train.compile:       # one cast per distinct input: wq, wk, wv read the same normed tensor, w1 and w3 too
        inputs = {w: v for w, v in inputs.items() if w not in ("wk", "wv", "w3") or
                  {"wk": "wq", "wv": "wq", "w3": "w1"}[w] not in converted}
    per = FLOAT8_CAST_BYTES["compiled" if train.compile else "eager"]
    return per * sum(inputs.values()), per * sum(shapes[w][2] for w in converted)


def _recomputed_matmuls(train: Training) -> tuple[str, ...]:
    """The projections a checkpointed block's backward computes again."""
    if train.checkpointing == "selective":
        return ()
    if train.checkpointing == TORCHTITAN_SELECTIVE:
        return ("wk", "wo", "w3")
    return ("wq", "wk", "wv", "wo", "w1", "w3", "w2")


def ring_attention_seconds(cfg: LlamaArgs, train: Training, rates: Rates, forwards: float = 3.5,
                           passes: int = 26) -> float:
    """One block's ring attention on one rank: cp.py computes it in eager block matmuls, not a fused kernel, so its
    FLOPs (`step_time`'s causal count for this rank's queries, `forwards` forwards: 3.5 with the backward, 1 for a
    recomputed forward) run at the matmul rate, and each visible score block (chunk x chunk per head, 2 x cp + 1 of
    them) is read or written `passes` times at the memory rate, counted from cp.py's ops: 10 in forward (the
    scores, scale, max, subtract, exp, sum, p @ v), 16 in backward (the scores again, lse, exp, dP, delta, dS)."""
    c = train.seq_len // (2 * train.cp)
    scores = (2 * train.cp + 1) * train.batch_size * cfg.n_heads * c * c * _dtype_bytes(train.precision)["matmul"]
    flops = forwards * 2 * rank_tokens(train) * train.seq_len * cfg.dim
    return flops / rates.matmul + passes * scores / rates.memory


def moe_matmul_seconds(cfg: LlamaArgs, train: Training, rates: Rates, forward_only: bool = False) -> float:
    """One MoE block's matmuls on one rank, forward and backward (or the forward alone, recomputed): the router's,
    and each of its E / ep experts' w1, w3 and w2 on the rows it takes under even routing, k / E of the tokens of
    the ep ranks (ep x n x k / E rows each)."""
    d, h, n, e, ep = cfg.dim, cfg.hidden, rank_tokens(train), train.moe_experts, train.ep
    rows = -(-ep * n * train.moe_top_k // e)
    one = matmul_seconds if forward_only else _forward_backward
    return one(n, d, e, rates) + e // ep * sum(one(*s, rates) for s in ((rows, d, h), (rows, d, h), (rows, h, d)))


def bus_bandwidth(size: int, stride: int, rates: Rates) -> float:
    """A group's bus bandwidth: the links inside a node where it fits in one; across nodes every member that shares
    a node runs its own ring through its own network card (NCCL's channels), so the node's cards add up, to at most
    the links inside the node. `stride`: ranks between neighbouring members."""
    span = (size - 1) * stride + 1                                  # ranks between the group's first and last
    if span <= rates.gpus_per_node:
        return rates.intra
    per_node = max(1, min(size, rates.gpus_per_node // stride))
    return min(rates.intra, rates.inter * per_node)


def communication_seconds(cfg: LlamaArgs, train: Training, layout: Layout, rates: Rates, rank: int = 0) -> dict:
    """{'overlapped': seconds that can hide behind compute, 'exposed': seconds that cannot, 'tp_blocks': the
    exposed seconds of the blocks' tensor-parallel collectives (async TP's to hide)} of `rank`'s collectives in one
    step, each at its group's bus bandwidth plus a latency per call (see `step_time`)."""
    tp, out = layout.tp, {"overlapped": 0.0, "exposed": 0.0, "tp_blocks": 0.0}
    stride = {"tp": 1, "dp_shard": tp, "dp_replicate": tp * layout.dp_shard, "pp": tp * layout.dp, "cp": tp,
              "ep": tp, "ep_replicas": tp * train.ep}
    for r in communication(cfg, train, layout, rank):
        bw = bus_bandwidth(r["group_size"], stride[r["group"]], rates)
        seconds = r["sent_bytes"] / bw + r["calls"] * rates.latency
        if r["what"].startswith(("FSDP", "HSDP", "DDP")):
            out["exposed"] += seconds / r["calls"]                    # one call's worth is not hidden
            out["overlapped"] += seconds - seconds / r["calls"]
        elif r["what"].startswith("context-parallel ring") and "backward" not in r["what"]:
            out["overlapped"] += seconds
        else:
            out["exposed"] += seconds
            if r["what"].startswith(("TP sequence parallel", "TP recomputed")):
                out["tp_blocks"] += seconds
    return out


# async TP: each all-gather (reduce-scatter) is cut into tp pieces that overlap the matmul pieces they feed (follow);
# the first piece of the shorter of the two cannot overlap anything: 1 / tp of it stays exposed
ASYNC_TP_RESIDUAL = "the first of tp pieces"


def _block_seconds(cfg: LlamaArgs, train: Training, rates: Rates, n: int, tp: int, blocks: list[int]) -> dict:
    """One micro-batch through `blocks` on one rank, by pass: {'F': forward, 'I': the backward's input gradients
    with whatever checkpointing recomputes, 'W': the weight gradients} seconds of matmuls, and of attention, and the
    elementwise bytes (`elementwise_bytes`, `float8_cast_bytes`) of each pass."""
    again = len(checkpointed_blocks(cfg, train, blocks))
    whole = again if train.checkpointing in ("full", "alternate") else 0
    shapes = _block_matmuls(cfg, n, tp)
    if train.moe_experts:                           # the experts in place of w1, w3, w2
        shapes = {w: s for w, s in shapes.items() if w not in ("w1", "w3", "w2")}
    mm, converted = dict.fromkeys("FIW", 0.0), float8_block_linears(cfg, train, tp)
    for w, shape in shapes.items():
        f, i, g = _passes(*shape, rates, w in converted)
        mm["F"], mm["I"], mm["W"] = mm["F"] + len(blocks) * f, mm["I"] + len(blocks) * i, mm["W"] + len(blocks) * g
        mm["I"] += again * f if w in _recomputed_matmuls(train) else 0.0
    if train.moe_experts:
        forward = moe_matmul_seconds(cfg, train, rates, forward_only=True)
        backward = moe_matmul_seconds(cfg, train, rates) - forward
        mm["F"] += len(blocks) * forward
        mm["I"] += len(blocks) * backward / 2 + whole * forward
        mm["W"] += len(blocks) * backward / 2
    if train.cp > 1 and train.cp_attention == "ring":
        forward = ring_attention_seconds(cfg, train, rates, forwards=1, passes=10)
        attention = {"F": len(blocks) * forward, "I": len(blocks) * (ring_attention_seconds(cfg, train, rates)
                                                                      - forward) + whole * forward, "W": 0.0}
    else:
        forward = 2 * n * train.seq_len * cfg.dim / tp / rates.attention
        attention = {"F": len(blocks) * forward, "I": (2.5 * len(blocks) + whole) * forward, "W": 0.0}
    per_token = elementwise_bytes(cfg, train, tp)
    cast_f, cast_b = float8_cast_bytes(cfg, train, tp)
    traffic = {"F": len(blocks) * n * (per_token + cast_f),
               "I": n * (2 * len(blocks) * per_token + again * (per_token + cast_f) + len(blocks) * cast_b), "W": 0.0}
    if train.cp > 1 and train.cp_attention == "allgather":     # merging each kv chunk's partial output (fp32)
        merge = train.cp * n * cfg.dim / tp * 12
        traffic["F"] += len(blocks) * merge
        traffic["I"] += (2 * len(blocks) + whole) * merge
    return {"matmul": mm, "attention": attention, "traffic": traffic}


def step_time(cfg: LlamaArgs, train: Training, layout: Layout, rates: Rates, rank: int = 0) -> dict:
    """One step's seconds on `rank`, from achieved rates (not one fraction of a peak), with its parts.

    - matmuls, shape by shape (`matmul_seconds`), the forward's and the backward's, and again those a checkpointed
      block recomputes (full: all; torchtitan's per-op policy: wk, wo, w3; the recipe's: none); under float8 the
      blocks' projections at the float8 rate (`Rates.float8`), the output head in the compute dtype;
    - attention at fused attention's rate, FlashAttention-2's count (forward 4 b s^2 h d / 2 when causal, backward
      2.5 forwards), its forward again where a whole block is recomputed; under cp the ring's eager blocks
      (`ring_attention_seconds`) or, with torch's all-gathered keys and values, the rank's causal share at the fused
      rate; an MoE's matmuls expert by expert (`moe_matmul_seconds`);
    - elementwise work at the memory rate (`elementwise_bytes`: backward twice the forward's bytes, and a
      checkpointed block's forward again; float8's casts, `float8_cast_bytes`), the loss over the vocabulary,
      autocast's weight casts, the optimizer;
    - communication (`communication`): FSDP2's and DDP's collectives overlap with the compute except one call's
      worth per kind and whatever exceeds the compute; tensor-parallel, loss and pipeline traffic sit on the
      critical path, except under async TP (`Training.async_tp`): the blocks' TP collectives then overlap the
      block matmuls, all but ASYNC_TP_RESIDUAL (min(comm, matmul) / tp); a group that spans nodes runs at the
      inter-node rate; each call pays the latency; the ring's forward shifts overlap, its backward's do not; the
      experts' all-to-alls and gradient all-reduce are exposed;
    - the pipeline's bubble from its schedule's own order (`schedule_order`), replayed (`replay`) with this rank's
      forward and backward of a micro-batch as every stage's: 1F1B's (pp - 1) / (m + pp - 1); the interleaved
      schedules less; zero bubble fills it with the weights' gradients.
    """
    c = coordinates(layout, rank)
    tp, micro = layout.tp, train.grad_accum
    n = rank_tokens(train)
    blocks, first, last = pipeline_rank_layers(cfg, layout, c["pp"], train.chunks)
    parts = _block_seconds(cfg, train, rates, n, tp, blocks)
    block_matmuls = sum(parts["matmul"].values())
    if last:
        f, i, g = _passes(n, cfg.dim, cfg.vocab_size // tp, rates)
        parts["matmul"]["F"] += f
        parts["matmul"]["I"] += i
        parts["matmul"]["W"] += g
        parts["traffic"]["I"] += n * cfg.vocab_size / tp * (32 + (12 if _dtype_bytes(train.precision)["matmul"] == 2
                                                                  else 0))
    state = model_state(cfg, train, layout, rank)
    weights = state["elements"] if not layout.fsdp else 0
    casts = 6 * weights if train.precision == "bf16-autocast" else 0
    converted = sum(count * math.prod(tp_local_shape(shape, d, tp, c["tp"]))
                    for _, params, count in stage_groups(cfg, layout, c["pp"], train.moe_experts, train.chunks)
                    for name, shape, d in params if float8_converted(name, cfg, train, tp))
    casts += converted * FLOAT8_CAST_BYTES["compiled" if train.compile else "eager"] * 2 / \
        (layout.dp_shard if train.float8 and recipe_job(cfg, train, layout).float8_all_gather else 1)
    per_step = (68 if train.optimizer == "adamw" else 36) * state["elements"] / rates.memory
    seconds = {k: parts["matmul"][k] + parts["attention"][k] + parts["traffic"][k] / rates.memory for k in "FIW"}
    seconds["I"] += casts / rates.memory
    compute = micro * sum(seconds.values()) + per_step
    comm = communication_seconds(cfg, train, layout, rates, rank)
    exposed = comm["exposed"]
    if train.async_tp and tp > 1:
        exposed -= min(comm["tp_blocks"], micro * block_matmuls) * (tp - 1) / tp
    busy = max(compute, comm["overlapped"]) + exposed
    bubble = 0.0 if layout.pp == 1 else pipeline_bubble(train.pp_schedule, layout.pp, micro, train.chunks,
                                                        round(seconds["I"] / seconds["F"], 3),
                                                        round(seconds["W"] / seconds["F"], 3))[c["pp"]]
    return {"seconds": busy / (1 - bubble), "matmul": micro * sum(parts["matmul"].values()),
            "attention": micro * sum(parts["attention"].values()),
            "memory": micro * sum(parts["traffic"].values()) / rates.memory + casts * micro / rates.memory + per_step,
            "comm_overlapped": comm["overlapped"], "comm_exposed": exposed, "bubble": bubble,
            "rates": rates.sources}


def tokens_per_gpu(cfg: LlamaArgs, train: Training, layout: Layout, rates: Rates) -> float:
    """Tokens/s per GPU: a step's tokens over the slowest pipeline rank's step time, per GPU."""
    seconds = max(step_time(cfg, train, layout, rates, s * layout.world // layout.pp)["seconds"]
                  for s in range(layout.pp))
    return train.batch_size * train.seq_len * train.grad_accum * data_ranks(layout, train) / seconds / layout.world


def calibrate(run: MeasuredRun, rates: Rates) -> float:
    """The factor on `rates`' compute rates (matmul, float8, attention: `Rates.scaled`) at which the planner predicts
    `run`'s tokens/s per GPU. It carries what the datasheet and the planner's shares do not know of that GPU and
    that software (a power limit, the kernels; on a small model, Python's overhead) to every plan made with it;
    memory and link rates stay. Bisection (the prediction rises with the factor); ValueError where no factor from
    1e-6 to 1000 reaches the run (one bound by its communication). Solved once per run and rates (`_CALIBRATED`)."""
    key = repr((run, rates))
    if key in _CALIBRATED:
        return _CALIBRATED[key]
    lo, hi = 1e-6, 1e3

    def tokens(factor: float) -> float:
        return tokens_per_gpu(run.cfg, run.train, run.layout, rates.scaled(factor, ""))

    if not tokens(lo) <= run.tokens_per_s <= tokens(hi):
        raise ValueError(f"no compute rate predicts {run.tokens_per_s:,.0f} tokens/s per GPU for {run.source}: "
                         f"from {tokens(lo):,.0f} to {tokens(hi):,.0f} between 1e-6 and 1000 times the rates given")
    while hi / lo > 1 + 1e-6:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if tokens(mid) < run.tokens_per_s else (lo, mid)
    _CALIBRATED[key] = math.sqrt(lo * hi)
    return _CALIBRATED[key]


_CALIBRATED: dict[str, float] = {}


# ------------------------------------------------------------------------------------------- 7. the plan and the search

ASSUMPTIONS = (
    "model state: fp32 master weights and gradients, AdamW's two fp32 moments (SGD: one); FSDP2 pads dim 0",
    "activations: eager PyTorch, flash attention (no s x s scores); a pipeline rank holds the micro-batches its "
    "schedule's order has not yet freed; compiled blocks keep what eager keeps, less the checkpointed outputs no "
    "backward reads",
    "memory: the largest of the loss's backward, a block's backward and the optimizer step, as the caching "
    "allocator counts it; reserved = allocated x (1 + the overhead of a published run); 2 GiB kept free for CUDA's "
    "context and NCCL",
    "time: matmuls at a measured rate by shape, attention at FlashAttention-2's published share, elementwise work at "
    "the measured copy rate; FSDP/DDP traffic hidden but one call per kind, TP, loss and pipeline traffic exposed; "
    "the bubble replayed from the schedule's order, every stage as long as this rank's",
    "float8 (torchao, the blocks' linear layers, not the output head): their matmuls at the float8 datasheet peak x "
    "the bf16 share; FSDP2 gathers their weights in 1 byte under tensorwise scaling; under tp a block's all-gathers "
    "carry float8; each converted matmul's inputs and output gradients cast (FLOAT8_CAST_BYTES per element); "
    "fp32 master weights stay; with checkpointing the same activations as bf16",
    "async TP (torchtitan's; not in the recipe): the blocks' TP collectives overlap the matmuls they feed, "
    "max(comm, matmul) + min(comm, matmul) / tp",
    "context parallel (cp.py's ring): each rank keeps seq_len/cp tokens' activations and the ring's q, k, v, output "
    "and log-sum-exp (selective checkpointing recomputes the ring whole); k, v and their gradients sent around "
    "the ring, the forward's shifts hidden, the backward's exposed; the ring's eager attention at the matmul rate "
    "plus its score blocks at the memory rate; its backward buffers counted from cp.py, not measured; torch's "
    "all-gather context parallel (torchtitan's): the keys and values gathered each pass, fused attention on the "
    "rank's causal share",
    "mixture of experts (moe.py, dropless): parameters, activations and all-to-all bytes as moe.py keeps and sends "
    "them, under even routing (each expert k/E of the tokens; the bytes that leave a rank are (ep-1)/ep of those "
    "dispatched); under ep each rank holds its E/ep experts whole (fp32, outside FSDP2) and all-reduces their "
    "gradients over the dp/ep replicas once per step; all-to-alls exposed; MFU counts the active weights (router "
    "and k experts); the experts' backward temporaries and an uneven router's skew are not counted",
    "not planned: CPU offload; what zero bubble keeps past its weight gradients (the count is a floor there)",
)


@dataclass
class Plan:
    cfg: LlamaArgs
    train: Training
    layout: Layout
    ranks: list[dict]          # per detailed rank: coordinates, model state, activations, memory
    communication: list[dict]  # rank 0's collectives per step
    time: dict | None          # the slowest stage's step, with tokens/s per GPU and MFU
    gpu: str | GPU | None = None
    memory_factor: float = 1.0  # a measured run's peak over its plan's (`calibrated_rates`): applied to both figures

    @property
    def peak(self) -> float:
        """The largest allocated peak over the detailed ranks, in bytes."""
        return max(r["memory"]["allocated"] for r in self.ranks) * self.memory_factor

    @property
    def reserved(self) -> float:
        return max(r["memory"]["reserved"] for r in self.ranks) * self.memory_factor

    def command(self, script: str = "scripts/train/train.py", nodes: int = 1, **extra) -> str:
        return torchrun_command(self.cfg, self.train, self.layout, script, nodes, **extra)


def data_ranks(layout: Layout, train: Training) -> int:
    """The ranks that read different batches (job.ParallelDims.data_ranks: cp of the data-parallel ranks share one)."""
    return ParallelDims(layout.dp_replicate, layout.dp_shard, layout.tp, layout.pp, train.cp, train.ep).data_ranks


def recipe_flags(train: Training, layout: Layout) -> dict:
    """train.py's flags (job.FLAGS' names) for a plan's layout and step, those at their default left out; with the
    model's (job.model_flags) they are the torchrun line that runs the plan, and without them the recipe's Job that
    `check_layout` checks."""
    used = {k: v for k, v in (("cp", train.cp), ("ep", train.ep)) if v > 1}
    if train.moe_experts:
        used.update(moe_experts=train.moe_experts, moe_top_k=train.moe_top_k)
    if layout.pp > 1 and train.pp_schedule != "1f1b":
        used["pp_schedule"] = train.pp_schedule
    if train.float8:
        used["float8"] = train.float8
    return {"seq_len": train.seq_len, "dp_replicate": layout.dp_replicate, "dp_shard": layout.dp_shard,
            "tp": layout.tp, "pp": layout.pp, **used, "accum": train.grad_accum,
            "batch": train.batch_size * data_ranks(layout, train) * train.grad_accum,
            "dtype": "fp32" if train.precision == "fp32" else "bf16", "ac": train.checkpointing,
            "compile": train.compile}




def not_in_recipe(train: Training) -> list[str]:
    """What a plan uses that the recipe does not build (the planner plans it, the torchrun line leaves it out)."""
    return [what for what, used in (("async TP", train.async_tp),
                                    ("torch's all-gather context parallel", train.cp_attention == "allgather"),
                                    ("the loss on a float32 copy of the logits", train.loss == "float32"),
                                    ("torchtitan's per-op checkpointing", train.checkpointing == TORCHTITAN_SELECTIVE))
            if used]


def check_layout(cfg: LlamaArgs, train: Training, layout: Layout) -> None:
    """ValueError (one line) for a plan the recipe refuses: every rule of its spec (job.RULES: the mesh against the
    model, the 1F1B schedule's micro-batches, --cp's and --moe-experts' limits, ...) on the recipe's Job of this
    plan, as train.py runs them at its start; and the planner's own: bf16-fsdp is FSDP2's policy."""
    if train.precision == "bf16-fsdp" and not layout.fsdp:
        raise ValueError(f"precision bf16-fsdp needs FSDP2, which {layout_name(layout)} does not apply (use "
                         "bf16-autocast)")
    ring = train.cp_attention == "ring"      # torch's all-gather context parallel: not cp.py's rules, its own
    recipe_job(cfg, train if ring else dataclasses.replace(train, cp=1), layout).check(stages_per_rank=train.chunks)
    if not ring and (layout.dp_shard % train.cp or train.seq_len % (2 * train.cp)):
        raise ValueError(f"cp {train.cp} takes ranks of dp_shard {layout.dp_shard} and balances 2 x cp chunks of "
                         f"each sequence of {train.seq_len}: one does not divide")


def plan(cfg: LlamaArgs, train: Training, layout: Layout, rates: Rates | None = None,
         ranks: list[int] | None = None, gpu: str | GPU | None = None) -> Plan:
    """Bytes per rank (model state, activations, the memory a GPU reports), rank 0's communication per step, and
    the step time of the slowest stage when `rates` are given (with tokens/s per GPU, and MFU against `gpu`'s
    datasheet). `ranks`: which ranks to detail (default: every rank; the ranks of one tp x dp_shard slice of each
    stage differ only by FSDP's uneven last shards)."""
    check_layout(cfg, train, layout)
    if rates is not None and train.float8 and not rates.float8:
        raise ValueError("float8 needs float8 matmuls (Hopper, Ada or later): these rates have none")
    rows = []
    for rank in (range(layout.world) if ranks is None else ranks):
        mem = memory(cfg, train, layout, rank)
        rows.append({"rank": rank, **coordinates(layout, rank), **mem["state"], "activations": mem["activations"],
                     "memory": mem})
    time = None
    if rates is not None:
        stages = [step_time(cfg, train, layout, rates, s * layout.world // layout.pp) for s in range(layout.pp)]
        time = max(stages, key=lambda t: t["seconds"])
        tokens = train.batch_size * train.seq_len * train.grad_accum * data_ranks(layout, train)
        time["tokens_per_s_per_gpu"] = tokens / time["seconds"] / layout.world
        if gpu:
            device = GPUS[gpu] if isinstance(gpu, str) else gpu
            column = "fp32" if train.precision == "fp32" else "bf16"     # the recipe's Meter counts against it
            peak = float8_datasheet_peak(device.device, column, float8_flop_share(cfg, train.seq_len, layout.tp))[0] \
                if train.float8 else datasheet_flops(device.device, column)[0]
            flops = flops_per_token(cfg, train.seq_len, train.moe_experts, train.moe_top_k)
            time["mfu"] = time["tokens_per_s_per_gpu"] * flops / peak
    return Plan(cfg, train, layout, rows, communication(cfg, train, layout, 0), time, gpu)


def _factorizations(n: int, parts: int):
    if parts == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in _factorizations(n // d, parts - 1):
                yield (d, *rest)


def layouts(world: int) -> list[Layout]:
    """Every (dp_replicate, dp_shard, tp, pp) whose product is `world`."""
    return [Layout(*f) for f in _factorizations(world, 4)]


def fitting_layouts(cfg: LlamaArgs, gpus: int, gpu: str | GPU, rates: Rates | None = None, *, seq_len: int,
                    global_batch: int, batch_size: int = 1, dtype: str = "bf16", checkpointing=CHECKPOINTING,
                    compile: bool = True, max_tp: int | None = None, fixed: dict | None = None,
                    memory_factor: float = 1.0, **settings) -> list[Plan]:
    """The layouts of `gpus` GPUs `gpu` (a GPU, or a key of GPUS) and checkpointing modes whose reserved memory
    (times `memory_factor`), with NON_TORCH_BYTES beside it, fits the GPU, each at `global_batch` sequences per step
    of micro-batches of `batch_size`, fastest estimate first (rates: `gpu_rates(gpu)` unless given).

    The accumulation follows from the layout: grad_accum = global_batch / (batch_size x data-parallel ranks, cp of
    which share a batch); layouts that cannot split the batch so, tp beyond one node (`max_tp`, default the node's
    GPUs), degrees other than `fixed` ({"tp": 8, ...}), or that the recipe refuses are left out. The precision is
    what the recipe's --dtype gives there (`recipe_precision`); `settings`: Training's other fields (cp,
    moe_experts, moe_top_k, ep, pp_schedule, float8, async_tp).
    """
    device = GPUS[gpu] if isinstance(gpu, str) else gpu
    rates = rates or gpu_rates(device, "fp32" if dtype == "fp32" else "bf16")
    max_tp = device.gpus_per_node if max_tp is None else max_tp
    cp = settings.get("cp", 1)
    found = []
    for layout, ac in itertools.product(layouts(gpus), checkpointing):
        data = layout.dp // cp if layout.dp_shard % cp == 0 else 0
        if layout.tp > max_tp or not data or global_batch % (batch_size * data) or \
                any(getattr(layout, k) != v for k, v in (fixed or {}).items()):
            continue
        train = Training(seq_len=seq_len, batch_size=batch_size, grad_accum=global_batch // (batch_size * data),
                         precision=recipe_precision(dtype, layout), checkpointing=ac, compile=compile, **settings)
        try:
            check_layout(cfg, train, layout)
        except ValueError:
            continue
        # each stage's first rank: its FSDP shards are never the short ones, so its memory is its stage's largest
        p = plan(cfg, train, layout, rates, ranks=[s * layout.world // layout.pp for s in range(layout.pp)], gpu=gpu)
        p.memory_factor = memory_factor
        if p.reserved + NON_TORCH_BYTES <= device.memory:
            found.append(p)
    return sorted(found, key=lambda p: (p.time["seconds"], p.reserved))


# -------------------------------------------------------------------------------------------------- 8. the command line

def torchrun_command(cfg: LlamaArgs, train: Training, layout: Layout, script: str = "scripts/train/train.py",
                     nodes: int = 1, init_from: str | None = None, **extra) -> str:
    """The recipe's command line for this plan: one node with --standalone, several with c10d rendezvous
    (HOST:29500 stands for the first node's address); its flags are job.argv's, the model's (job.model_flags) and
    the plan's (`recipe_flags`). `extra` adds flags by name (`steps=100` gives --steps 100)."""
    if train.optimizer != "adamw":
        raise ValueError("the recipe trains with AdamW")
    values = {**model_flags(cfg, init_from), **recipe_flags(train, layout), **extra}
    if not init_from and model_shape(values)[0] != cfg:
        raise ValueError(f"the recipe's preset is as long as its sequences: max_seq_len {cfg.max_seq_len}, seq_len "
                         f"{train.seq_len}")
    per_node = layout.world // nodes
    if nodes == 1:
        head = f"torchrun --standalone --nproc-per-node={per_node}"
    else:
        head = (f"torchrun --nnodes={nodes} --nproc-per-node={per_node} --rdzv-backend=c10d "
                "--rdzv-endpoint=HOST:29500 --rdzv-id=plan")
    return " ".join([head, script, *argv(values)])


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes:.0f} B"


def collectives_line(records: list[dict]) -> str:
    """Rank 0's collectives of a step in one line: per record, the bytes of one call and the calls."""
    return "; ".join(f"{r['what'].split(' (')[0]} {r['kind']} {_size(r['buffer_bytes'] / r['calls'])} x {r['calls']}"
                     for r in records) or "none"


def describe(p: Plan) -> str:
    """A plan in a few lines: the layout, each detailed rank's bytes, the communication, the time."""
    lines = [f"{layout_name(p.layout)} (world {p.layout.world}); {p.train.precision}, {p.train.optimizer}, "
             f"checkpointing {p.train.checkpointing}{', compiled' if p.train.compile else ''}; micro-batch "
             f"{p.train.batch_size} x {p.train.seq_len} tokens, {p.train.grad_accum} per step"
             + (f"; cp {p.train.cp}" if p.train.cp > 1 else "")
             + (f"; {p.train.moe_experts} experts, top {p.train.moe_top_k}, ep {p.train.ep}" if p.train.moe_experts
                else "")]
    for r in p.ranks:
        a, m = r["allocated"], r["memory"]
        lines.append(f"  rank {r['rank']:>3} (stage {r['pp']}): params {a['parameters'] / GIB:.2f} GiB, grads "
                     f"{a['gradients'] / GIB:.2f}, optimizer {a['optimizer'] / GIB:.2f}, activations kept "
                     f"{r['activations']['kept'] / GIB:.2f}; peak at {m['phase']}: {m['allocated'] / GIB:.2f} GiB "
                     f"allocated, {m['reserved'] / GIB:.2f} GiB reserved")
    for c in p.communication:
        lines.append(f"  {c['what']}: {c['calls']} x {c['kind']} over {c['group']} ({c['group_size']}), "
                     f"{c['buffer_bytes'] / GIB:.3f} GiB buffer, {c['sent_bytes'] / GIB:.3f} GiB sent by rank 0")
    if p.time:
        t = p.time
        lines.append(f"  step ~{t['seconds']:.3g} s: matmuls {t['matmul']:.3g}, attention {t['attention']:.3g}, "
                     f"memory-bound {t['memory']:.3g}, comm hidden {t['comm_overlapped']:.3g} / exposed "
                     f"{t['comm_exposed']:.3g}, bubble {t['bubble']:.0%}; {t['tokens_per_s_per_gpu']:,.0f} tokens/s "
                     f"per GPU" + (f", MFU {t['mfu']:.1%}" if "mfu" in t else ""))
    return "\n".join(lines)


def replace(obj, **changes):
    """dataclasses.replace, re-exported so a notebook varies one field of a config without importing dataclasses."""
    return dataclasses.replace(obj, **changes)


def model_of(args) -> tuple[LlamaArgs, int]:
    """(the model, the sequence length) of plan.py's flags, as train.py makes them (job.model_shape): --model's
    preset with the shape flags, or --init-from's config.json. ValueError, one line."""
    if args.init_from:
        try:
            hf = config_from_hf(json.loads((Path(args.init_from) / "config.json").read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--init-from {args.init_from}: {str(e).splitlines()[0] if str(e) else repr(e)}")
        return model_shape(vars(args), hf)
    if not args.model:
        raise ValueError("give --model (a preset) or --init-from (a Hugging Face folder)")
    return model_shape(vars(args))


def read_run_log(path: str | Path) -> tuple[MeasuredRun, dict]:
    """A short run of the recipe, from the file its --metrics flag wrote (JSON lines): (the run as a MeasuredRun,
    the run's own record: its flags, model, world size, device and the peak its MFU is against). The tokens/s is the
    median of its log lines but the first (which holds the start-up: compilation, the allocator's warm-up); the
    memory the largest of their peaks. ValueError (one line) for a file that is not such a log."""
    records, header = [], None
    try:
        for line in Path(path).read_text().splitlines():
            record = json.loads(line)
            if "run" in record:
                header, records = record["run"], []           # a resumed run starts its own record
            elif "tokens_per_s" in record:
                records.append(record)
    except (OSError, ValueError) as e:
        raise ValueError(f"--calibrate {path}: {str(e).splitlines()[0]}") from None
    if header is None or len(records) < 2:
        raise ValueError(f"--calibrate {path}: not a train.py --metrics file with two log lines or more (run it for "
                         "a few --log-every intervals: the first line holds the start-up)")
    f, cfg = header["flags"], LlamaArgs(**header["model"])
    layout = Layout(f["dp_replicate"], f["dp_shard"], f["tp"], f["pp"])
    dims = ParallelDims(*dataclasses.astuple(layout), f["cp"], f["ep"])
    train = Training(seq_len=f["seq_len"], batch_size=f["batch"] // (dims.data_ranks * f["accum"]),
                     grad_accum=f["accum"], precision=recipe_precision(f["dtype"], layout), checkpointing=f["ac"],
                     compile=f["compile"], fused_rms_norm=header["device"] != "cpu", cp=f["cp"],
                     moe_experts=f["moe_experts"], moe_top_k=f["moe_top_k"], ep=f["ep"],
                     pp_schedule=f["pp_schedule"], float8=f.get("float8"))
    later = records[1:]
    reserved = [r["reserved_gib"] for r in later if r.get("reserved_gib") is not None]
    run = MeasuredRun(cfg, train, layout, statistics.median(r["tokens_per_s"] for r in later) / header["world"],
                      f"{path}: {header['world']} x {header['device']}, {layout_name(layout)}",
                      max(r["peak_memory_gib"] for r in later) if header["device"] != "cpu" else None,
                      max(reserved) if reserved else None)
    return run, header


def calibrated_rates(run: MeasuredRun, header: dict, gpu: GPU, dtype: str = "bf16") -> tuple[Rates, float, str]:
    """(`gpu`'s rates with its compute rates at the share of the peak the measured run reached, the run's memory
    over its plan's (1 where it measured no allocator), a line that says so).

    The run's device rates: the GPU table's row of its name (its own `calibration` set aside), or on a CPU the
    matmul rate it measured (its MFU's peak), no memory or link rate (its factor takes in all). `calibrate` solves
    the factor on those at which the planner predicts the run; the share of the run's peak it makes carries to
    `gpu`'s datasheet. The memory factor: the allocator's peak reserved (or allocated) against the plan's."""
    device = header["device"]
    here = next((g for g in GPUS.values() if g.device == device), None)
    if here is not None:
        base = gpu_rates(dataclasses.replace(here, calibration=None), dtype)
    elif device == "cpu":
        peak = header["peak_flops"]
        base = Rates(peak, peak, math.inf, math.inf, math.inf, 0.0, run.layout.world, 0, ("measured on the CPU",))
    else:
        base = gpu_rates(dataclasses.replace(gpu, calibration=None), dtype)    # a GPU the table lacks: as `gpu`
    share = calibrate(run, base) * base.matmul / header["peak_flops"]
    target = gpu_rates(dataclasses.replace(gpu, calibration=None), dtype)
    peak = datasheet_flops(gpu.device, "fp32" if dtype == "fp32" else "bf16")[0]
    rates = target.scaled(share * peak / target.matmul, f"the share of the peak ({share:.1%}) {run.source} reached")
    planned = plan(run.cfg, run.train, run.layout, ranks=[s * run.layout.world // run.layout.pp
                                                          for s in range(run.layout.pp)])
    measured = (run.reserved_gib, planned.reserved) if run.reserved_gib else (run.allocated_gib, planned.peak)
    factor = measured[0] * GIB / measured[1] if measured[0] else 1.0
    line = f"calibrated from {run.source}: {run.tokens_per_s:,.0f} tokens/s per GPU, {share:.1%} of its peak in " \
        "the planner's terms; memory " + (
            f"{measured[0]:.2f} GiB measured against {measured[1] / GIB:.2f} GiB planned: x {factor:.3f} on every "
            "plan" if measured[0] else "not corrected (a CPU's resident set is no allocator's peak)")
    return rates, factor, line


def main(argv: list[str] | None = None) -> None:
    p = parser("plan", __doc__.split("\n\n")[0], choices={"gpu": sorted(GPUS), "pp_schedule": tuple(SCHEDULES)})
    args = p.parse_args(argv)
    fixed = {k: getattr(args, k) for k in MESH_DIMS if getattr(args, k)}
    compiled = not (args.cp > 1 or args.moe_experts) if args.compile is None else args.compile  # ring, experts: eager
    batch, gpu = args.batch or args.gpus, GPUS[args.gpu]
    try:
        at_least(vars(args))
        cfg, seq_len = model_of(args)
        # the recipe's rules at the fixed degrees, the rest at 1 (cp and ep out of the smallest dp_shard they fit)
        dims = ParallelDims(fixed.get("dp_replicate", 1), fixed.get("dp_shard", math.lcm(args.cp, args.ep)),
                            fixed.get("tp", 1), fixed.get("pp", 1), args.cp, args.ep)
        Job(**dataclasses.asdict(dims), model_config=cfg, init_from=args.init_from, seq_len=seq_len,
            moe_experts=args.moe_experts, moe_top_k=args.moe_top_k, compile=compiled, accum=dims.pp,
            batch=dims.data_ranks * dims.pp, pp_schedule=args.pp_schedule).check(stages_per_rank=SCHEDULES[
                args.pp_schedule])
        if args.float8 and (args.dtype == "fp32" or not hardware_peak(gpu.device, FLOAT8_DTYPE)):
            raise ValueError(f"--float8 needs --dtype bf16 and a GPU with float8 matmuls; {args.gpu} has none"
                             if args.dtype != "fp32" else "--float8 trains in bf16: drop --dtype fp32")
        rates = gpu_rates(gpu, args.dtype, args.matmul_tflops * 1e12 if args.matmul_tflops else None)
        memory_factor, calibrated = 1.0, None
        if args.calibrate:
            rates, memory_factor, calibrated = calibrated_rates(*read_run_log(args.calibrate), gpu, args.dtype)
    except ValueError as e:
        p.error(str(e))
    if fixed and args.gpus % math.prod(fixed.values()):
        p.error(f"the fixed degrees ({math.prod(fixed.values())} GPUs) do not divide --gpus {args.gpus}")
    dp_options = {l.dp // args.cp for l in layouts(args.gpus) if all(getattr(l, k) == v for k, v in fixed.items())
                  and l.dp_shard % math.lcm(args.cp, args.ep) == 0}
    if not dp_options:
        p.error(f"--cp {args.cp} and --ep {args.ep} divide no --dp-shard of a layout of {args.gpus} GPUs")
    if not any(batch % (args.micro_batch * dp) == 0 for dp in dp_options):
        p.error(f"--batch {batch} does not split into micro-batches of {args.micro_batch} over the "
                      f"data-parallel ranks of any layout of {args.gpus} GPUs ({sorted(dp_options)})")
    fits = fitting_layouts(cfg, args.gpus, args.gpu, rates, seq_len=seq_len, global_batch=batch,
                           batch_size=args.micro_batch, dtype=args.dtype, checkpointing=tuple(args.ac), fixed=fixed,
                           compile=compiled, memory_factor=memory_factor, cp=args.cp, moe_experts=args.moe_experts,
                           moe_top_k=args.moe_top_k, ep=args.ep, pp_schedule=args.pp_schedule, float8=args.float8,
                           async_tp=args.async_tp)
    if calibrated:
        print(calibrated)
    print_plans(cfg, args, seq_len, batch, gpu, rates, fits)


def print_plans(cfg: LlamaArgs, args, seq_len: int, batch: int, gpu: GPU, rates: Rates, fits: list) -> None:
    """main's report: the model and its counts, the rates and the allocator's model, the layouts that fit (fastest
    first) with their collectives, and the torchrun line of the best; exit status 1 where none fits."""
    e, k = args.moe_experts, args.moe_top_k
    print(f"{parameter_count(cfg, e) / 1e9:.2f}B parameters"
          + (f" ({active_parameter_count(cfg, e, k) / 1e9:.2f}B active: {k} of {e} experts)" if e else "")
          + f" ({cfg.n_layers} layers, dim {cfg.dim}, {cfg.n_heads} heads, "
          f"{cfg.n_kv_heads} key/value heads, vocabulary {cfg.vocab_size}); {batch} sequences of {seq_len} "
          f"tokens per step on {args.gpus} x {args.gpu} ({gpu.memory / GIB:.2f} GiB each, "
          f"{NON_TORCH_BYTES / GIB:.0f} GiB of it kept for CUDA and NCCL)")
    print("rates: " + "; ".join(rates.sources))
    print(f"memory: reserved = allocated x (1 + {allocator_overhead('selective'):.3f}, or "
          f"{allocator_overhead('full'):.3f} with full checkpointing): {ALLOCATOR_SOURCE}")
    if not fits:
        print(f"no layout of {args.gpus} GPUs fits {gpu.memory / GIB:.2f} GiB at this batch: more GPUs, a smaller "
              "--micro-batch, or a shorter --seq-len")
        sys.exit(1)
    print(f"{len(fits)} layouts fit; the fastest {min(args.top, len(fits))}, by predicted step time:")
    print(f"{'dp_rep':>6} {'dp_shard':>8} {'tp':>3} {'pp':>3} {'ac':>10} {'micro x accum':>13} {'alloc GiB':>9} "
          f"{'reserved':>8} {'step s':>7} {'tok/s/GPU':>9} {'MFU':>6}")
    for p in fits[:args.top]:
        l, t = p.layout, p.time
        print(f"{l.dp_replicate:>6} {l.dp_shard:>8} {l.tp:>3} {l.pp:>3} {p.train.checkpointing:>10} "
              f"{f'{p.train.batch_size} x {p.train.grad_accum}':>13} {p.peak / GIB:>9.2f} {p.reserved / GIB:>8.2f} "
              f"{t['seconds']:>7.3f} {t['tokens_per_s_per_gpu']:>9,.0f} {t['mfu']:>6.1%}")
        print(f"{'':>8}collectives per step (rank 0, per call x calls): {collectives_line(p.communication)}")
    nodes = args.gpus // gpu.gpus_per_node if args.gpus > gpu.gpus_per_node and not args.gpus % gpu.gpus_per_node else 1
    print("the best, as the recipe runs it:\n$ " + fits[0].command(nodes=nodes, init_from=args.init_from))
    missing = not_in_recipe(fits[0].train)
    if missing:
        print(f"planned but not in that line: {', '.join(missing)} (the recipe does not build it)")

if __name__ == "__main__":
    main()
