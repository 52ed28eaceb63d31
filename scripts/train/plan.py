# From the PyTorch distributed cookbook: the cells tagged 'script:train/plan.py' in
#   notebooks/10_parallelism_planner.ipynb
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
"""Plan a parallel layout for the cookbook's GPT before renting the GPUs: bytes per rank, bytes on the wire per
step, a step time, and the `torchrun` line of the training recipe that runs it.

Why a planner next to the recipe: "which layout for my model on my GPUs?" is answered by arithmetic that is easy to
get almost right (ZeRO's 16 bytes per parameter, the Korthikanti et al. activation formula) and whose last 10 % is
what decides whether a run fits: FSDP2 pads each parameter's dim 0, autocast keeps bf16 copies of the weights and
casts a normed input once per projection, DTensor's sequence parallelism saves the all-gathered input of every
column-wise projection, the loss keeps fp32 log-probabilities of the whole vocabulary. Every term here names the
tensor it counts, so a notebook can hold it against what a run on the reader's machine holds and sends.

Imports torch and the standard library only (torch only for `count_parameters`, on the meta device): copy it with
the recipe. Conventions:
- bytes are per rank; "held" counts the rank's own elements (a DTensor's local shard), "allocated" the storages
  behind them (FSDP2 keeps parameters and gradients in buffers padded to ceil(dim0 / N) rows on every rank);
- a layout is (dp_replicate, dp_shard, tp, pp); ranks are numbered like `init_device_mesh` numbers a mesh of shape
  (pp, dp_replicate, dp_shard, tp): tp fastest;
- a step is `grad_accum` micro-batches of `batch_size` sequences of `seq_len` tokens on every data-parallel rank,
  run as the recipe (train.py, parallelize.py) runs it: FSDP2 reshards after forward and reduces every
  micro-batch, DDP reduces once per step, tensor parallelism is sequence-parallel with a parallel loss, a
  pipeline runs 1F1B with its stage's FSDP2 parameters gathered through the step;
- what a run measured shaped the terms: notebook 10 holds each against the recipe on CPU ranks (and a GPU's
  allocator where there is one), tests/test_plan.py against hand-worked cases and published formulas.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field

PRECISIONS = ("fp32", "bf16-autocast", "bf16-fsdp")
OPTIMIZERS = {"adamw": 2, "sgd": 1}   # fp32 state tensors per parameter: Adam's two moments; SGD's momentum buffer
CHECKPOINTING = ("none", "selective", "full", "alternate")   # the recipe's --ac
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")   # the recipe's mesh order, slowest first
GB = 1e9


@dataclass(frozen=True)
class ModelConfig:
    """The GPT's shape: the fields of the recipe's `GPTConfig` (scripts/train/model.py) that decide its bytes."""

    vocab_size: int = 256
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    max_seq_len: int = 1024
    mlp_ratio: int = 4

    @property
    def hidden(self) -> int:
        return self.mlp_ratio * self.dim

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@dataclass(frozen=True)
class Layout:
    """How many ranks along each mesh dimension; the world size is their product."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> bool:
        """The recipe applies FSDP2 when it shards, and for replicas beside tp or pp (HSDP with one shard)."""
        return self.dp_shard > 1 or (self.dp_replicate > 1 and (self.tp > 1 or self.pp > 1))

    @property
    def ddp(self) -> bool:
        return self.dp_replicate > 1 and not self.fsdp

    def coordinates(self, rank: int) -> dict[str, int]:
        """{mesh dim: this rank's index on it}, tp varying fastest (init_device_mesh's row-major order)."""
        sizes = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp}
        out = {}
        for name in reversed(MESH_DIMS):
            out[name] = rank % sizes[name]
            rank //= sizes[name]
        return out

    def __str__(self) -> str:
        return f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} tp={self.tp} pp={self.pp}"


@dataclass(frozen=True)
class Training:
    """What one optimizer step does on every data-parallel rank, and how."""

    seq_len: int = 1024
    batch_size: int = 8          # sequences per micro-batch per data-parallel rank
    grad_accum: int = 1          # micro-batches per step (the pipeline's micro-batches when pp > 1)
    optimizer: str = "adamw"
    precision: str = "fp32"
    checkpointing: str = "none"
    fused_rms_norm: bool = True  # CUDA's rms_norm is one kernel; torch 2.13's CPU path composes it (see below)

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, not {self.optimizer!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, not {self.precision!r}")
        if self.checkpointing not in CHECKPOINTING:
            raise ValueError(f"checkpointing must be one of {CHECKPOINTING}, not {self.checkpointing!r}")


@dataclass(frozen=True)
class Ceilings:
    """The rates a step time is estimated from: measured on the reader's machine (notebook 10), or a datasheet's.

    matmul: FLOP/s of a large matmul per compute dtype ("fp32", "bf16"); busbw: bytes/s a collective reaches as
    nccl-tests' bus bandwidth (ring: all-reduce moves 2(n-1)/n of its buffer per rank, all-gather and reduce-scatter
    (n-1)/n), "intra" inside a node, "inter" between nodes; copy: bytes/s of a device memory copy (each byte counted
    once); latency: seconds per collective call, the fixed cost.
    """

    matmul: dict = field(default_factory=lambda: {"fp32": 1e12, "bf16": 1e12})
    busbw: dict = field(default_factory=lambda: {"intra": 10 * GB, "inter": 10 * GB})
    copy: float = 10 * GB
    latency: float = 20e-6
    gpus_per_node: int = 8
    source: str = "placeholder"


# Datasheet figures for planning on hardware this machine does not have (dense, no sparsity). A plan made from them
# is a ranking, not a promise: notebook 10 replaces them with what it measures. Bus bandwidths are about 80 % of the
# link's rate per direction, what nccl-tests typically reaches; bf16 matmuls reach about 70 % of the datasheet rate.
DATASHEETS = {
    "H100-SXM-80GB": Ceilings(matmul={"fp32": 0.7 * 67e12, "bf16": 0.7 * 989e12}, busbw={"intra": 360 * GB,
                              "inter": 40 * GB}, copy=3.35e12 / 2 * 0.9, latency=30e-6, source="H100 SXM datasheet"),
    "A100-SXM-80GB": Ceilings(matmul={"fp32": 0.7 * 19.5e12, "bf16": 0.7 * 312e12}, busbw={"intra": 230 * GB,
                              "inter": 20 * GB}, copy=2.0e12 / 2 * 0.9, latency=30e-6, source="A100 SXM datasheet"),
}
MEMORY_PRESETS_GB = (24, 40, 80, 141)


# ----------------------------------------------------------------------------------------------- the parameters

def parameter_shapes(model: ModelConfig) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(name, shape, tensor-parallel shard dim or None) of every parameter, in the model's order.

    The tp dims are the recipe's plan (parallelize.apply_tp): both embeddings row-wise (their rows split),
    wq/wk/wv/w1 and the output column-wise (their weight's dim 0), wo/w2 row-wise (dim 1), norms replicated.
    """
    d, h, v = model.dim, model.hidden, model.vocab_size
    shapes = [("tok_embeddings.weight", (v, d), 0), ("pos_embeddings.weight", (model.max_seq_len, d), 0)]
    for i in range(model.n_layers):
        p = f"layers.{i}."
        shapes += [(p + "attention_norm.weight", (d,), None),
                   (p + "attention.wq.weight", (d, d), 0), (p + "attention.wk.weight", (d, d), 0),
                   (p + "attention.wv.weight", (d, d), 0), (p + "attention.wo.weight", (d, d), 1),
                   (p + "ffn_norm.weight", (d,), None),
                   (p + "feed_forward.w1.weight", (h, d), 0), (p + "feed_forward.w2.weight", (d, h), 1)]
    shapes += [("norm.weight", (d,), None), ("output.weight", (v, d), 0)]
    return shapes


def parameter_count(model: ModelConfig) -> int:
    """P = V*D + S*D + L*(4*D^2 + 2*D*H + 2*D) + D + D*V (the model's formula, summed from its shapes)."""
    return sum(math.prod(shape) for _, shape, _ in parameter_shapes(model))


def count_parameters(build_model) -> int:
    """Parameters of the real model, built on the meta device (no memory): `build_model()` returns the module."""
    import torch

    with torch.device("meta"):
        return sum(p.numel() for p in build_model().parameters())


def _chunk(n: int, parts: int, index: int) -> int:
    """Length of part `index` when torch.chunk splits n into `parts` (ceil(n/parts) each, fewer or none at the end)."""
    size = -(-n // parts)
    return max(0, min(size, n - index * size))


def stage_layers(model: ModelConfig, pp: int, stage: int) -> range:
    """The layers pipeline stage `stage` owns: an equal, contiguous share (the recipe requires L divisible by pp)."""
    per = model.n_layers // pp
    return range(stage * per, (stage + 1) * per)


def stage_parameters(model: ModelConfig, layout: Layout, stage: int) -> list[tuple[str, tuple[int, ...], int | None]]:
    """The parameters of pipeline stage `stage` (embeddings on the first, norm and output on the last)."""
    layers = {str(i) for i in stage_layers(model, layout.pp, stage)}
    out = []
    for name, shape, tp_dim in parameter_shapes(model):
        if name.startswith("layers."):
            keep = name.split(".")[1] in layers
        elif name.startswith(("tok_embeddings", "pos_embeddings")):
            keep = stage == 0
        else:
            keep = stage == layout.pp - 1
        if keep:
            out.append((name, shape, tp_dim))
    return out


def tp_local_shape(shape: tuple[int, ...], tp_dim: int | None, tp: int, tp_rank: int) -> tuple[int, ...]:
    if tp_dim is None or tp == 1:
        return shape
    return tuple(_chunk(n, tp, tp_rank) if i == tp_dim else n for i, n in enumerate(shape))


def fsdp_groups(names: list[str]) -> dict[str, list[str]]:
    """The recipe's FSDP2 groups: one per transformer block (`fully_shard(block)`), the rest in the root."""
    groups: dict[str, list[str]] = {}
    for name in names:
        key = ".".join(name.split(".")[:2]) if name.startswith("layers.") else "root"
        groups.setdefault(key, []).append(name)
    return dict(sorted(groups.items(), key=lambda kv: kv[0] == "root"))


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


def model_state(model: ModelConfig, train: Training, layout: Layout, rank: int) -> dict:
    """Bytes of parameters, gradients and optimizer state on `rank`, held and allocated (FSDP2 padding included).

    FSDP2 (dp_shard > 1) shards each parameter's dim 0 over dp_shard with torch.chunk (after tp has taken its part:
    a 2-D parameter's local tensor is what FSDP splits): rank k owns chunk k, and every rank's shard lives in a
    buffer of ceil(dim0 / dp_shard) rows (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, `_init_sharded_param`:
    `padded_sharded_size = chunks[0].size()`); the gradient arrives in the same padded layout. The optimizer's state
    is `zeros_like` the unpadded local shard. DDP (dp_shard = 1) holds every parameter of its stage whole.
    Under tensor parallelism without FSDP2 the row-wise embeddings' gradients come back whole on every tp rank
    (DTensor's embedding backward; measured in notebook 10), twice their sharded size at tp = 2; FSDP2's
    reduce-scatter returns them sharded.
    """
    c = layout.coordinates(rank)
    b = _dtype_bytes(train.precision)
    shard = layout.dp_shard if layout.fsdp else 1
    held = padded = whole_grads = 0
    for name, shape, tp_dim in stage_parameters(model, layout, c["pp"]):
        local = tp_local_shape(shape, tp_dim, layout.tp, c["tp"])
        rest = math.prod(local[1:])
        held += _chunk(local[0], shard, c["dp_shard"]) * rest
        padded += -(-local[0] // shard) * rest
        if layout.tp > 1 and not layout.fsdp and "embeddings" in name:
            whole_grads += math.prod(shape) - math.prod(local)
    states = OPTIMIZERS[train.optimizer]
    return {
        "elements": held, "padded_elements": padded,
        "held": {"parameters": held * b["param"], "gradients": (held + whole_grads) * b["grad"],
                 "optimizer": held * 4 * states},
        "allocated": {"parameters": padded * b["param"], "gradients": (padded + whole_grads) * b["grad"],
                      "optimizer": held * 4 * states},
    }


# ---------------------------------------------------------------------------------------------- the activations

def layer_activations(model: ModelConfig, train: Training, tp: int) -> dict[str, float]:
    """Bytes autograd keeps for backward in one transformer block for one micro-batch, by tensor (no checkpointing).

    Korthikanti et al. (2022), "Reducing Activation Recomputation in Large Transformer Models", count
    s*b*h*(34 + 5*a*s/h) bytes per layer in fp16 (with tp and sequence parallelism t: s*b*h*(34/t + 5*a*s/(h*t))).
    Their 34 holds dropout masks (3 sbh bytes), LayerNorm and a 4h GELU MLP; their 5as/h the s^2 attention scores.
    This model has no dropout, RMSNorm, and attention by `F.scaled_dot_product_attention`, whose flash and
    memory-efficient kernels keep q, k, v, the output and one log-sum-exp per row, never the s x s scores; so the
    terms below, one per saved tensor. Under tp the recipe's sequence parallelism splits the residual stream along
    the sequence, but DTensor saves the all-gathered (whole) input of every column-wise projection: the two
    "gathered" terms do not shrink with tp (Megatron keeps the shard and gathers again in backward; DTensor does not).
    Under bf16 autocast the normed input is cast to bf16 once per projection it feeds (autocast caches casts of
    weights, not of activations): three copies for wq, wk, wv. RMSNorm: on CUDA `rms_norm` is one fused kernel
    that keeps its input and one fp32 rstd per row; torch 2.13 on the CPU composes it of pow, mean, rsqrt and mul
    on an fp32 copy of its input, and keeps that copy and x * rstd, both fp32 (`Training.fused_rms_norm=False`).
    """
    b = _dtype_bytes(train.precision)
    n = train.batch_size * train.seq_len                 # tokens of one micro-batch
    d, hidden, heads = model.dim, model.hidden, model.n_heads
    casts_qkv = 3 if train.precision == "bf16-autocast" else 1
    norm_in = b["residual"] if train.fused_rms_norm else 4     # the composite upcasts its input to fp32 first
    terms = {
        "norm inputs (x, h)": 2 * n * d * norm_in / tp,
        "norm rstd": 2 * n * 4 / tp,
        "attention input, gathered (q/k/v projections)": casts_qkv * n * d * b["matmul"],
        "q, k, v": 3 * n * d * b["matmul"] / tp,
        "attention output": n * d * b["matmul"] / tp,
        "attention log-sum-exp": n * heads * 4 / tp,
        "mlp input, gathered (w1)": n * d * b["matmul"],
        "mlp hidden before GELU": n * hidden * b["matmul"] / tp,
        "mlp hidden after GELU (w2 input)": n * hidden * b["matmul"] / tp,
    }
    if not train.fused_rms_norm:
        terms["norm x * rstd (composite RMSNorm, fp32)"] = 2 * n * d * 4 / tp
    return terms


def head_activations(model: ModelConfig, train: Training, tp: int) -> dict[str, float]:
    """Bytes kept outside the blocks for one micro-batch on the last stage: the final norm's input, the output
    projection's (gathered) input, the loss's fp32 log-probabilities over the vocabulary (split by tp under loss
    parallelism) and its int64 targets."""
    b = _dtype_bytes(train.precision)
    n = train.batch_size * train.seq_len
    d, v = model.dim, model.vocab_size
    norm = (n * d * b["residual"] if train.fused_rms_norm else 2 * n * d * 4) / tp
    return {
        "final norm input": norm + n * 4 / tp,
        "output projection input, gathered": n * d * b["matmul"],
        "log-probabilities (fp32)": n * v * 4 / tp,
        "targets": n * 8,
    }


def embedding_activations(train: Training) -> dict[str, float]:
    """The token ids and the positions the embeddings keep for their backward (int64)."""
    return {"token ids": train.batch_size * train.seq_len * 8, "positions": train.seq_len * 8}


def in_flight_microbatches(layout: Layout, train: Training, stage: int, schedule: str = "1f1b") -> int:
    """Micro-batches whose activations a stage holds at once: one without pipelining; under 1F1B stage s holds at
    most pp - s (the first stage pp), under GPipe all of the step's."""
    if layout.pp == 1:
        return 1
    if schedule == "gpipe":
        return train.grad_accum
    return min(layout.pp - stage, train.grad_accum)


def selective_block(model: ModelConfig, train: Training, tp: int) -> dict[str, float]:
    """What the recipe's per-op selective checkpointing keeps of one block: its input, and the outputs of the
    matmuls and of attention (its policy's MUST_SAVE ops); norms, GELU and adds are recomputed, and so are
    autocast's casts. Row-wise projections (wo, w2) output a partial sum over the whole sequence before their
    reduce-scatter, so under tp their outputs do not shrink."""
    b = _dtype_bytes(train.precision)
    n = train.batch_size * train.seq_len
    d, hidden = model.dim, model.hidden
    return {
        "block input": n * d * b["residual"] / tp,
        "q, k, v (wq, wk, wv outputs)": 3 * n * d * b["matmul"] / tp,
        "attention output and log-sum-exp": n * d * b["matmul"] / tp + n * model.n_heads * 4 / tp,
        "wo and w2 outputs (partial sums)": 2 * n * d * b["matmul"],
        "w1 output": n * hidden * b["matmul"] / tp,
    }


def activations(model: ModelConfig, train: Training, layout: Layout, rank: int, schedule: str = "1f1b") -> dict:
    """Activation bytes a rank keeps at its peak (the end of a forward, before the backward frees them), by term.

    Checkpointing, as the recipe's --ac: "full" keeps each block's input only (the residual stream,
    sequence-split under tp) and recomputes one block at a time in backward, so one block's activations come back
    at once; "selective" keeps what `selective_block` lists; "alternate" checkpoints every other block whole
    (blocks 0, 2, 4, ...) and keeps everything of the others. (Korthikanti's selective recomputation recomputes
    the s^2 attention scores only; flash attention never stores them, so here it would save nothing.)

    Under bf16 autocast the bf16 copies of the stage's matmul weights (`autocast_weight_copies`) are kept once,
    whatever the checkpointing: autocast caches each cast of a weight until its context exits, and the recipe's
    context spans the forward and the backward (a pipeline's, the whole step). "kept" is every micro-batch in
    flight plus that cache; "per_microbatch" leaves the cache out.
    """
    c = layout.coordinates(rank)
    tp, stage = layout.tp, c["pp"]
    blocks_here = list(stage_layers(model, layout.pp, stage))
    casts = autocast_weight_copies(model, train, layout, rank)
    one = sum(layer_activations(model, train, tp).values())
    n = train.batch_size * train.seq_len
    kept_input = n * model.dim * _dtype_bytes(train.precision)["residual"] / tp
    ac = train.checkpointing
    if ac == "none":
        blocks, recompute = len(blocks_here) * one, 0.0
    elif ac == "full":
        blocks, recompute = len(blocks_here) * kept_input, one if blocks_here else 0.0
    elif ac == "selective":
        blocks, recompute = len(blocks_here) * sum(selective_block(model, train, tp).values()), \
            (one - sum(selective_block(model, train, tp).values()) + kept_input) if blocks_here else 0.0
    else:
        checkpointed = sum(1 for i in blocks_here if i % 2 == 0)
        blocks = checkpointed * kept_input + (len(blocks_here) - checkpointed) * one
        recompute = one if checkpointed else 0.0
    terms = {"blocks": blocks}
    if stage == 0:
        terms["embedding"] = sum(embedding_activations(train).values())
    if stage == layout.pp - 1:
        terms["head"] = sum(head_activations(model, train, tp).values())
    micro = in_flight_microbatches(layout, train, stage, schedule)
    per_micro = sum(terms.values())
    cache = casts["block"] * len(blocks_here) + casts["head"]
    return {"per_microbatch": per_micro, "in_flight": micro, "autocast_cache": cache,
            "kept": per_micro * micro + cache, "recompute": recompute, "terms": terms}


def autocast_weight_copies(model: ModelConfig, train: Training, layout: Layout, rank: int) -> dict[str, float]:
    """bf16 copies of the matmul weights that autocast makes in forward and caches until its context exits (2 bytes
    each, the rank's tp shard): {"block": one block's, "head": the output projection's on the last stage}. (The
    recipe autocasts only where FSDP2 is not applied, so these are whole local weights.)"""
    if train.precision != "bf16-autocast":
        return {"block": 0.0, "head": 0.0}
    c = layout.coordinates(rank)
    d, hidden, tp = model.dim, model.hidden, layout.tp
    head = 2 * model.vocab_size * d / tp if c["pp"] == layout.pp - 1 else 0.0
    return {"block": 2 * (4 * d * d + 2 * d * hidden) / tp, "head": head}


def _group_elements(model: ModelConfig, layout: Layout, rank: int) -> dict[str, int]:
    """{FSDP group: elements of one rank's padded shard} on `rank`'s stage (the all-gather output is dp_shard x
    this; the reduce-scatter input too)."""
    c = layout.coordinates(rank)
    params = stage_parameters(model, layout, c["pp"])
    shard = layout.dp_shard
    out = {}
    for group, names in fsdp_groups([n for n, _, _ in params]).items():
        shapes = [tp_local_shape(s, d, layout.tp, c["tp"]) for n, s, d in params if n in names]
        out[group] = sum(-(-s[0] // shard) * math.prod(s[1:]) for s in shapes)
    return out


def transient(model: ModelConfig, train: Training, layout: Layout, rank: int) -> dict[str, float]:
    """Buffers alive beside the model state and the activations at the peak: FSDP2's all-gathered compute copy of
    the current and the prefetched group, the whole stage's under pipelining (the recipe keeps a stage's
    parameters gathered through its micro-batches) with its unsharded fp32 gradients; DDP's gradient buckets (a
    copy of every gradient); the gradient of the fp32 logits."""
    c = layout.coordinates(rank)
    b = _dtype_bytes(train.precision)
    out = {}
    if layout.fsdp:
        sizes = {g: e * layout.dp_shard for g, e in _group_elements(model, layout, rank).items()}
        if layout.pp > 1:
            out["FSDP gathered parameters (whole stage)"] = sum(sizes.values()) * b["gathered"]
            out["FSDP unsharded gradients (whole stage)"] = sum(sizes.values()) * b["reduce"]
        else:
            groups = sorted(sizes.values(), reverse=True)
            out["FSDP gathered parameters (two groups)"] = sum(groups[:2]) * b["gathered"]
    elif layout.ddp:
        out["DDP gradient buckets"] = model_state(model, train, layout, rank)["held"]["gradients"]
    if c["pp"] == layout.pp - 1:
        out["logits gradient"] = train.batch_size * train.seq_len * model.vocab_size * 4 / layout.tp
    return out


# ------------------------------------------------------------------------------------------------ communication

def _ring_factor(kind: str, n: int) -> float:
    """nccl-tests' bus factor: the share of a collective's buffer each rank sends on a ring."""
    if n <= 1:
        return 0.0
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "send": 1.0}[kind]


def _collective(what: str, kind: str, group: str, size: int, calls: int, nbytes: float, dtype_bytes: int) -> list:
    """The record of one (what, kind, group) of `communication`; none where the group has one rank or no call."""
    if size <= 1 or not calls:
        return []
    return [{"what": what, "kind": kind, "group": group, "group_size": size, "calls": calls, "buffer_bytes": nbytes,
             "dtype_bytes": dtype_bytes, "sent_bytes": nbytes * _ring_factor(kind, size)}]


def _data_parallel_collectives(model: ModelConfig, train: Training, layout: Layout, rank: int) -> list[dict]:
    """FSDP2's all-gathers and reduce-scatters per group (each block, the root), HSDP's all-reduce of the reduced
    shard, or DDP's one all-reduce of every gradient per step (see `communication`)."""
    b = _dtype_bytes(train.precision)
    micro = train.grad_accum
    if layout.fsdp:
        shard, groups = layout.dp_shard, _group_elements(model, layout, rank)
        gathers, reduces = (1, 1) if layout.pp > 1 else (2 * micro, micro)
        elements = sum(groups.values())
        return (_collective("FSDP parameters", "all_gather", "dp_shard", shard, gathers * len(groups),
                            gathers * elements * shard * b["gathered"], b["gathered"])
                + _collective("FSDP gradients", "reduce_scatter", "dp_shard", shard, reduces * len(groups),
                              reduces * elements * shard * b["reduce"], b["reduce"])
                + _collective("HSDP gradients", "all_reduce", "dp_replicate", layout.dp_replicate,
                              reduces * len(groups), reduces * elements * b["reduce"], b["reduce"]))
    if layout.ddp:
        return _collective("DDP gradients", "all_reduce", "dp_replicate", layout.dp_replicate, 1,
                           model_state(model, train, layout, rank)["held"]["gradients"], 4)
    return []


def _tensor_parallel_collectives(model: ModelConfig, train: Training, layout: Layout, stage: int) -> list[dict]:
    """Sequence parallelism's all-gathers and reduce-scatters per micro-batch (each block's two halves, the
    embeddings on the first stage, the output projection on the last), grouped by element width, and the
    parallel loss's all-reduces (see `communication`)."""
    b = _dtype_bytes(train.precision)
    micro, t = train.grad_accum, layout.tp
    n, s, d = train.batch_size * train.seq_len, train.seq_len, model.dim
    first, last = stage == 0, stage == layout.pp - 1
    blocks = len(stage_layers(model, layout.pp, stage))
    res, mat = b["residual"], b["matmul"]
    # (elements, dtype bytes) per micro-batch, forward and backward together
    gathers = [(n * d, res)] * (2 * blocks) + [(n * d, mat)] * (2 * blocks)
    scatters = [(n * d, mat)] * (2 * blocks) + [(n * d, res)] * (2 * blocks)
    if first:
        scatters += [(n * d, res), (s * d, res)]
        gathers += [(n * d, res), (s * d, res)]
    if last:
        gathers.append((n * d, res))
        scatters.append((n * d, res))
    by_width: dict = {}
    for kind, items in (("all_gather", gathers), ("reduce_scatter", scatters)):
        for elements, width in items:
            key = (kind, width)
            by_width[key] = (by_width.get(key, (0, 0))[0] + 1, by_width.get(key, (0, 0))[1] + elements * width)
    records = []
    for (kind, width), (calls, nbytes) in sorted(by_width.items()):
        records += _collective(f"TP sequence parallel ({width}-byte elements)", kind, "tp", t, micro * calls,
                               micro * nbytes, width)
    if last:
        records += _collective("TP parallel loss", "all_reduce", "tp", t, 3 * micro, 3 * micro * n * 4, 4)
    return records


def communication(model: ModelConfig, train: Training, layout: Layout, rank: int = 0) -> list[dict]:
    """The collectives `rank` takes part in during one step of the recipe, one record per (what, kind, group):
    calls, buffer bytes (the collective's logical buffer summed over calls: an all-gather's output, a
    reduce-scatter's input, an all-reduce's tensor, a point-to-point message) and bytes this rank sends on a ring.

    FSDP2 (the recipe shards with reshard_after_forward=True and reduces every micro-batch): per micro-batch and
    group (each block, the root), one all-gather in forward and one in backward, one reduce-scatter, and across
    dp_replicate (HSDP) one all-reduce of the reduced shard. Under pipelining a stage's parameters stay gathered
    and its gradients unreduced through the step: one all-gather and one reduction per group per step. DDP
    all-reduces every gradient once per step (no_sync on the other micro-batches). Tensor parallelism with
    sequence parallelism, per micro-batch: each block all-gathers the normed input before attention and before the
    MLP and reduce-scatters both outputs, and backward does the reverse; the embeddings reduce-scatter their
    lookups (positions: one sequence, broadcast over the batch) and gather the gradients back; the output
    projection gathers its input and reduce-scatters its gradient; the parallel loss all-reduces three fp32 values
    per token (max, sum of exponentials, target logit). Clipping all-reduces the per-tensor norms of DTensor
    gradients over each sharded mesh dimension, or a stage's squared norm over the pipeline. The pipeline sends
    each micro-batch's hidden states forward and their gradients back across each stage boundary.
    Not planned: under tp the norm weights' gradients stay partial sums and are all-reduced (dim elements each)
    wherever they are read; notebook 10 counts them.
    """
    stage = layout.coordinates(rank)["pp"]
    records = _data_parallel_collectives(model, train, layout, rank)
    if layout.tp > 1:
        records += _tensor_parallel_collectives(model, train, layout, stage)
    sharded_dims = [(g, size) for g, size in (("dp_shard", layout.dp_shard if layout.fsdp else 1), ("tp", layout.tp))
                    if size > 1]
    params = stage_parameters(model, layout, stage)
    for group, size in sharded_dims:
        records += _collective("gradient norm (per-tensor norms)", "all_reduce", group, size, 1, len(params) * 4, 4)
    if layout.pp > 1:
        records += _collective("gradient norm (stages' squared norms)", "all_reduce", "pp", layout.pp, 1, 4, 4)
        b = _dtype_bytes(train.precision)
        msg = train.batch_size * train.seq_len * model.dim * b["residual"] / layout.tp
        sends = (stage < layout.pp - 1) + (stage > 0)
        records += _collective("pipeline hidden states and their gradients", "send", "pp", layout.pp,
                               train.grad_accum * sends, train.grad_accum * sends * msg, b["residual"])
    return records


# ------------------------------------------------------------------------------------------------------ the time

def flops_per_step(model: ModelConfig, train: Training, layout: Layout, rank: int = 0) -> float:
    """Matmul FLOPs of one step on `rank`: 6 per token per weight of its stage's matmuls (2 forward, 4 backward),
    plus causal attention's 6 * s * D per token per layer (QK^T and AV, half the square each way), split by tp;
    checkpointing adds a forward of what it recomputes (full: every block; alternate: every other block;
    selective: no matmul)."""
    c = layout.coordinates(rank)
    params = stage_parameters(model, layout, c["pp"])
    matmul_weights = sum(math.prod(s) for n, s, _ in params if len(s) == 2 and "embeddings" not in n)
    block_weights = sum(math.prod(s) for n, s, _ in params if n.startswith("layers.") and len(s) == 2)
    blocks_here = list(stage_layers(model, layout.pp, c["pp"]))
    tokens = train.batch_size * train.seq_len * train.grad_accum
    attention = 2 * train.seq_len * model.dim * len(blocks_here)        # forward FLOPs per token, causal
    forward = 2 * matmul_weights + attention
    share = {"none": 0.0, "selective": 0.0, "full": 1.0,
             "alternate": sum(1 for i in blocks_here if i % 2 == 0) / max(1, len(blocks_here))}
    blocks_forward = 2 * block_weights + attention
    return tokens * (3 * forward + share[train.checkpointing] * blocks_forward) / layout.tp


def step_time(model: ModelConfig, train: Training, layout: Layout, ceilings: Ceilings, rank: int = 0) -> dict:
    """An estimate of one step's seconds from the ceilings, with its parts.

    Assumptions (shown with every plan): matmuls run at the measured matmul rate of the compute dtype; memory-bound
    work (the optimizer's pass over its states and the elementwise ops around the matmuls, counted as reading and
    writing each activation twice, and again for what checkpointing recomputes) at the copy rate; FSDP2's and
    DDP's collectives overlap with the compute of the other blocks except one call's worth per step (FSDP2
    prefetches one block ahead; DDP reduces buckets while backward runs); tensor-parallel and loss collectives sit
    on the critical path (no async TP); the pipeline idles (pp - 1) / (m + pp - 1) of the step (1F1B's bubble, m
    micro-batches); a group that spans nodes runs at the inter-node bus bandwidth; each call also pays the latency.
    """
    compute_dtype = "fp32" if train.precision == "fp32" else "bf16"
    compute = flops_per_step(model, train, layout, rank) / ceilings.matmul[compute_dtype]
    state = model_state(model, train, layout, rank)["held"]
    everything = activations(model, replace(train, checkpointing="none"), layout, rank)["per_microbatch"]
    kept = activations(model, train, layout, rank)["per_microbatch"]
    recomputed = {"none": 0.0, "full": 1.0, "alternate": 0.5, "selective": 1 - kept / everything}[train.checkpointing]
    memory = (2 * sum(state.values()) + 4 * everything * (1 + recomputed) * train.grad_accum) / ceilings.copy
    overlapped = exposed = 0.0
    stride = {"tp": 1, "dp_shard": layout.tp, "dp_replicate": layout.tp * layout.dp_shard,
              "pp": layout.tp * layout.dp}
    for r in communication(model, train, layout, rank):
        span = (r["group_size"] - 1) * stride[r["group"]] + 1      # ranks between the group's first and last
        bw = ceilings.busbw["intra" if span <= ceilings.gpus_per_node else "inter"]
        seconds = r["sent_bytes"] / bw + r["calls"] * ceilings.latency
        if r["group"] in ("dp_shard", "dp_replicate") and r["what"].startswith(("FSDP", "HSDP", "DDP")):
            first_last = seconds / max(1, r["calls"])   # one call's worth is not hidden
            exposed += first_last
            overlapped += seconds - first_last
        else:
            exposed += seconds
    busy = max(compute + memory, overlapped) + exposed
    bubble = (layout.pp - 1) / (train.grad_accum + layout.pp - 1) if layout.pp > 1 else 0.0
    total = busy / (1 - bubble)
    return {"seconds": total, "compute": compute, "memory": memory, "comm_overlapped": overlapped,
            "comm_exposed": exposed, "bubble": bubble, "ceilings": ceilings.source}


ASSUMPTIONS = (
    "model state: fp32 master weights and gradients, AdamW's two fp32 moments (SGD: one); FSDP2 pads dim 0",
    "activations: eager PyTorch (torch.compile keeps fewer), flash/efficient attention (no s x s scores), "
    "1F1B keeps pp - s micro-batches on stage s",
    "peak: model state + kept activations + one recomputed block + gathered parameters, buckets and the logits' "
    "gradient; allocator cache, fragmentation, CUDA context and NCCL buffers not counted (keep headroom)",
    "time: matmuls at the measured rate; elementwise work at the copy rate; FSDP/DDP traffic hidden behind compute "
    "but one call per step; TP, loss and pipeline traffic exposed; 1F1B bubble (pp-1)/(m+pp-1)",
)


# ------------------------------------------------------------------------------------------------------- plans

@dataclass
class Plan:
    model: ModelConfig
    train: Training
    layout: Layout
    ranks: list[dict]          # per rank: model state, activations, transient buffers, peak
    communication: list[dict]  # rank 0's collectives per step
    time: dict | None

    @property
    def peak(self) -> float:
        """The largest peak over ranks, in bytes."""
        return max(r["peak"] for r in self.ranks)

    def command(self, script: str = "scripts/train/train.py", nodes: int = 1, **extra) -> str:
        return torchrun_command(self.model, self.train, self.layout, script, nodes, **extra)


def check_layout(model: ModelConfig, train: Training, layout: Layout) -> None:
    """Raise ValueError for a layout the recipe refuses (parallelize.check_layout and train.parse_args): tp must
    divide the heads, the vocabulary and the sequence; pp the layers; 1F1B needs as many micro-batches as stages;
    the recipe's model is as long as its sequences."""
    if min(layout.dp_replicate, layout.dp_shard, layout.tp, layout.pp) < 1:
        raise ValueError(f"every mesh dimension needs at least 1 rank: {layout}")
    if model.dim % model.n_heads:
        raise ValueError(f"the width ({model.dim}) must divide into {model.n_heads} heads")
    for what, n in (("attention heads", model.n_heads), ("vocabulary", model.vocab_size),
                    ("sequence length", train.seq_len)):
        if n % layout.tp:
            raise ValueError(f"tp={layout.tp} must divide the {what} ({n})")
    if model.n_layers % layout.pp:
        raise ValueError(f"pp={layout.pp} must divide the layers ({model.n_layers})")
    if layout.pp > 1 and train.grad_accum < layout.pp:
        raise ValueError(f"pipelining over {layout.pp} stages needs at least as many micro-batches "
                         f"(grad_accum={train.grad_accum})")
    if train.seq_len > model.max_seq_len:
        raise ValueError(f"seq_len {train.seq_len} exceeds the model's max_seq_len {model.max_seq_len}")
    if train.precision == "bf16-fsdp" and not layout.fsdp:
        raise ValueError(f"precision bf16-fsdp needs FSDP2, which {layout} does not apply (use bf16-autocast)")


def plan(model: ModelConfig, train: Training, layout: Layout, ceilings: Ceilings | None = None,
         ranks: list[int] | None = None, schedule: str = "1f1b") -> Plan:
    """Bytes per rank (model state, activations, transient buffers, peak), rank 0's communication per step, and
    the step time when `ceilings` are given. `ranks`: which ranks to detail (default: every rank; the ranks of
    one tp x dp_shard slice of each stage differ only by FSDP's uneven last shards)."""
    check_layout(model, train, layout)
    rows = []
    for rank in (range(layout.world) if ranks is None else ranks):
        state = model_state(model, train, layout, rank)
        act = activations(model, train, layout, rank, schedule)
        extra = transient(model, train, layout, rank)
        peak = sum(state["allocated"].values()) + act["kept"] + act["recompute"] + sum(extra.values())
        rows.append({"rank": rank, **layout.coordinates(rank), **state, "activations": act, "transient": extra,
                     "peak": peak})
    time = step_time(model, train, layout, ceilings) if ceilings is not None else None
    return Plan(model, train, layout, rows, communication(model, train, layout, 0), time)


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


def fitting_layouts(model: ModelConfig, gpus: int, memory_bytes: float, ceilings: Ceilings, *, seq_len: int,
                    global_batch: int, batch_size: int = 1, optimizer: str = "adamw", dtype: str = "bf16",
                    checkpointing=CHECKPOINTING, max_tp: int | None = None, headroom: float = 0.9) -> list[Plan]:
    """The layouts of `gpus` ranks (and checkpointing choices) whose peak fits `headroom` x `memory_bytes`, each
    at `global_batch` sequences per step of micro-batches of `batch_size`, fastest estimate first.

    The accumulation follows from the layout: grad_accum = global_batch / (batch_size x data-parallel ranks);
    layouts that cannot split the batch so, tp beyond one node (`max_tp`, default `ceilings.gpus_per_node`), or
    that the recipe refuses are left out. The precision is what the recipe's --dtype gives there
    (`recipe_precision`). `headroom` keeps room for the allocator's cache and fragmentation, CUDA's context and
    NCCL's buffers, none of which the plan counts.
    """
    max_tp = ceilings.gpus_per_node if max_tp is None else max_tp
    found = []
    for layout, ac in itertools.product(layouts(gpus), checkpointing):
        if layout.tp > max_tp or global_batch % (batch_size * layout.dp):
            continue
        train = Training(seq_len=seq_len, batch_size=batch_size, grad_accum=global_batch // (batch_size * layout.dp),
                         optimizer=optimizer, precision=recipe_precision(dtype, layout), checkpointing=ac)
        try:
            check_layout(model, train, layout)
        except ValueError:
            continue
        # each stage's first rank: its FSDP shards are never the short ones, so its peak is its stage's largest
        stage_ranks = [stage * layout.world // layout.pp for stage in range(layout.pp)]
        p = plan(model, train, layout, ceilings, ranks=stage_ranks)
        if p.peak <= headroom * memory_bytes:
            found.append(p)
    return sorted(found, key=lambda p: (p.time["seconds"], p.peak))


def torchrun_command(model: ModelConfig, train: Training, layout: Layout, script: str = "scripts/train/train.py",
                     nodes: int = 1, **extra) -> str:
    """The recipe's command line for this plan: one node with --standalone, several with c10d rendezvous
    (HOST:29500 stands for the first node's address). `extra` adds flags (`steps=100` gives --steps 100).

    The recipe's model is byte-level (a vocabulary of 256) and as long as its sequences (--seq-len sets both):
    a plan of another vocabulary or length is refused rather than given a command that trains something else.
    """
    if model.vocab_size != 256 or model.max_seq_len != train.seq_len:
        raise ValueError("the recipe trains a 256-token vocabulary at max_seq_len = seq_len; this plan has "
                         f"vocab_size {model.vocab_size}, max_seq_len {model.max_seq_len}, seq_len {train.seq_len}")
    if train.optimizer != "adamw":
        raise ValueError("the recipe trains with AdamW")
    per_node = layout.world // nodes
    if nodes == 1:
        head = f"torchrun --standalone --nproc-per-node={per_node}"
    else:
        head = (f"torchrun --nnodes={nodes} --nproc-per-node={per_node} --rdzv-backend=c10d "
                "--rdzv-endpoint=HOST:29500 --rdzv-id=plan")
    flags = {"dp-replicate": layout.dp_replicate, "dp-shard": layout.dp_shard, "tp": layout.tp, "pp": layout.pp,
             "dim": model.dim, "n-layers": model.n_layers, "n-heads": model.n_heads, "mlp-ratio": model.mlp_ratio,
             "seq-len": train.seq_len, "batch": train.batch_size * layout.dp * train.grad_accum,
             "accum": train.grad_accum, "dtype": "fp32" if train.precision == "fp32" else "bf16",
             "ac": train.checkpointing}
    flags.update({k.replace("_", "-"): v for k, v in extra.items()})
    return head + " " + script + "".join(f" --{k} {v}" for k, v in flags.items())


def describe(p: Plan) -> str:
    """A plan in a few lines: the layout, each detailed rank's bytes, the communication, the time."""
    gib = 2 ** 30
    lines = [f"{p.layout} (world {p.layout.world}); {p.train.precision}, {p.train.optimizer}, checkpointing "
             f"{p.train.checkpointing}; micro-batch {p.train.batch_size} x {p.train.seq_len} tokens, "
             f"{p.train.grad_accum} per step"]
    for r in p.ranks:
        a = r["allocated"]
        lines.append(f"  rank {r['rank']:>3} (stage {r['pp']}): params {a['parameters'] / gib:.2f} GiB, grads "
                     f"{a['gradients'] / gib:.2f}, optimizer {a['optimizer'] / gib:.2f}, activations "
                     f"{(r['activations']['kept'] + r['activations']['recompute']) / gib:.2f}, transient "
                     f"{sum(r['transient'].values()) / gib:.2f}; peak {r['peak'] / gib:.2f} GiB")
    for c in p.communication:
        lines.append(f"  {c['what']}: {c['calls']} x {c['kind']} over {c['group']} ({c['group_size']}), "
                     f"{c['buffer_bytes'] / gib:.3f} GiB buffer, {c['sent_bytes'] / gib:.3f} GiB sent by rank 0")
    if p.time:
        t = p.time
        lines.append(f"  step ~{t['seconds']:.3g} s: compute {t['compute']:.3g}, memory-bound {t['memory']:.3g}, "
                     f"comm hidden {t['comm_overlapped']:.3g} / exposed {t['comm_exposed']:.3g}, bubble "
                     f"{t['bubble']:.0%} ({t['ceilings']})")
    return "\n".join(lines)


def replace(obj, **changes):
    """dataclasses.replace, re-exported so a notebook varies one field of a config without importing dataclasses."""
    return dataclasses.replace(obj, **changes)
