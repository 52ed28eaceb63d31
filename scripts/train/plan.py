"""Plan a parallel layout for the cookbook's GPT before renting the GPUs: bytes per rank, bytes on the wire per
step, a step time, and the `torchrun` line of the training recipe that runs it.

Why a planner next to the recipe: "which layout for my model on my GPUs?" is answered by arithmetic that is easy to
get almost right (ZeRO's 16 bytes per parameter, the Korthikanti et al. activation formula) and whose last 10 % is
what decides whether a run fits: FSDP2 pads each parameter's dim 0, autocast keeps bf16 copies of the weights and
casts a normed input once per projection, DTensor's sequence parallelism saves the all-gathered input of every
projection, the loss keeps fp32 log-probabilities of the whole vocabulary. Every term here names the tensor it
counts, so a notebook can hold it against what a run on the reader's machine holds and sends (notebook 10 does).

Imports torch and the standard library only (torch only for `count_parameters`, on the meta device): copy it with
the recipe. Conventions:
- bytes are per rank; "held" counts the rank's own elements (a DTensor's local shard), "allocated" the storages
  behind them (FSDP2 keeps parameters and gradients in buffers padded to ceil(dim0 / N) rows on every rank);
- a layout is (dp_replicate, dp_shard, tp, pp); ranks are numbered like `init_device_mesh` numbers a mesh of shape
  (pp, dp_replicate, dp_shard, tp): tp fastest;
- a step is `grad_accum` micro-batches of `batch_size` sequences of `seq_len` tokens on every data-parallel rank;
  gradients are reduced once per step (`set_requires_gradient_sync` / `no_sync` on the other micro-batches).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field

PRECISIONS = ("fp32", "bf16-autocast", "bf16-fsdp")
OPTIMIZERS = {"adamw": 2, "sgd": 1}   # fp32 state tensors per parameter: Adam's two moments; SGD's momentum buffer
CHECKPOINTING = ("none", "selective", "full")
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

    The tp dims are the recipe's plan (torchtitan's): embeddings row-wise (vocab rows split), wq/wk/wv/w1 and the
    output column-wise (their weight's dim 0), wo/w2 row-wise (dim 1), norms and positions replicated.
    """
    d, h, v = model.dim, model.hidden, model.vocab_size
    shapes = [("tok_embeddings.weight", (v, d), 0), ("pos_embeddings.weight", (model.max_seq_len, d), None)]
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


def _dtype_bytes(precision: str) -> dict[str, int]:
    """Bytes per element of: the stored (master) parameters, their gradients, the compute copy FSDP2 gathers, the
    activations of the residual stream and of the matmul inputs, the gradient reduction."""
    if precision == "fp32":
        return {"param": 4, "grad": 4, "gathered": 4, "residual": 4, "matmul": 4, "reduce": 4}
    if precision == "bf16-autocast":   # fp32 weights and residual stream; autocast casts each matmul's inputs to bf16
        return {"param": 4, "grad": 4, "gathered": 4, "residual": 4, "matmul": 2, "reduce": 4}
    return {"param": 4, "grad": 4, "gathered": 2, "residual": 2, "matmul": 2, "reduce": 4}   # FSDP2 bf16 params, fp32 reduce


def model_state(model: ModelConfig, train: Training, layout: Layout, rank: int) -> dict:
    """Bytes of parameters, gradients and optimizer state on `rank`, held and allocated (FSDP2 padding included).

    FSDP2 (dp_shard > 1) shards each parameter's dim 0 over dp_shard with torch.chunk (after tp has taken its part:
    a 2-D parameter's local tensor is what FSDP splits): rank k owns chunk k, and every rank's shard lives in a
    buffer of ceil(dim0 / dp_shard) rows (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, `_init_sharded_param`:
    `padded_sharded_size = chunks[0].size()`); the gradient arrives in the same padded layout. The optimizer's state
    is `zeros_like` the unpadded local shard. DDP (dp_shard = 1) holds every parameter of its stage whole.
    """
    c = layout.coordinates(rank)
    b = _dtype_bytes(train.precision)
    shard = layout.dp_shard
    held = padded = 0
    for _, shape, tp_dim in stage_parameters(model, layout, c["pp"]):
        local = tp_local_shape(shape, tp_dim, layout.tp, c["tp"])
        rest = math.prod(local[1:])
        held += _chunk(local[0], shard, c["dp_shard"]) * rest
        padded += -(-local[0] // shard) * rest
    states = OPTIMIZERS[train.optimizer]
    return {
        "elements": held, "padded_elements": padded,
        "held": {"parameters": held * b["param"], "gradients": held * b["grad"], "optimizer": held * 4 * states},
        "allocated": {"parameters": padded * b["param"], "gradients": padded * b["grad"],
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
    that keeps its input and one fp32 rstd per row; torch 2.13 on the CPU composes it of pow, mean, rsqrt and mul,
    which also keep x * rstd (`Training.fused_rms_norm=False` counts that).
    """
    b = _dtype_bytes(train.precision)
    n = train.batch_size * train.seq_len                 # tokens of one micro-batch
    d, hidden, heads = model.dim, model.hidden, model.n_heads
    casts_qkv = 3 if train.precision == "bf16-autocast" else 1
    terms = {
        "norm inputs (x, h)": 2 * n * d * b["residual"] / tp,
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
        terms["norm x * rstd (composite RMSNorm)"] = 2 * n * d * b["residual"] / tp
    return terms


def head_activations(model: ModelConfig, train: Training, tp: int) -> dict[str, float]:
    """Bytes kept outside the blocks for one micro-batch on the last stage: the final norm's input, the output
    projection's (gathered) input, the loss's fp32 log-probabilities over the vocabulary (split by tp under loss
    parallelism) and its int64 targets."""
    b = _dtype_bytes(train.precision)
    n = train.batch_size * train.seq_len
    d, v = model.dim, model.vocab_size
    norm = (1 if train.fused_rms_norm else 2) * n * d * b["residual"] / tp
    return {
        "final norm input": norm + n * 4 / tp,
        "output projection input, gathered": n * d * b["matmul"],
        "log-probabilities (fp32)": n * v * 4 / tp,
        "targets": n * 8,
    }


def embedding_activations(train: Training) -> dict[str, float]:
    """The token ids and the positions the embeddings keep for their backward (int64)."""
    return {"token ids": train.batch_size * train.seq_len * 8, "positions": train.seq_len * 8}


def in_flight_microbatches(layout: Layout, train: Training, stage: int) -> int:
    """Micro-batches whose activations a stage holds at once: one without pipelining; under 1F1B stage s holds at
    most pp - s (the first stage pp), never more than the step has."""
    if layout.pp == 1:
        return 1
    return min(layout.pp - stage, train.grad_accum)


def activations(model: ModelConfig, train: Training, layout: Layout, rank: int) -> dict:
    """Activation bytes a rank keeps at its peak (the end of a forward, before the backward frees them), by term.

    Checkpointing: "full" keeps each block's input only (the residual stream, sequence-split under tp) and
    recomputes one block at a time in backward, so one block's activations come back at once; "selective" is the
    recipe's per-layer selective checkpointing: every second block checkpointed whole, the others keep everything.
    (Korthikanti's selective recomputation recomputes the s^2 attention scores only; flash attention never stores
    them, so here it would save nothing.) Under bf16 autocast a block that is not checkpointed also keeps the bf16
    copies of its weights (`autocast_weight_copies`), once per micro-batch in flight.
    """
    c = layout.coordinates(rank)
    tp, stage = layout.tp, c["pp"]
    layers = len(stage_layers(model, layout.pp, stage))
    casts = autocast_weight_copies(model, train, layout, rank)
    one = sum(layer_activations(model, train, tp).values()) + casts["block"]
    n = train.batch_size * train.seq_len
    kept_input = n * model.dim * _dtype_bytes(train.precision)["residual"] / tp
    if train.checkpointing == "none":
        blocks, recompute = layers * one, 0.0
    elif train.checkpointing == "full":
        blocks, recompute = layers * kept_input, one if layers else 0.0
    else:
        checkpointed = layers // 2
        blocks, recompute = checkpointed * kept_input + (layers - checkpointed) * one, one if checkpointed else 0.0
    terms = {"blocks": blocks}
    if stage == 0:
        terms["embedding"] = sum(embedding_activations(train).values())
    if stage == layout.pp - 1:
        terms["head"] = sum(head_activations(model, train, tp).values()) + casts["head"]
    micro = in_flight_microbatches(layout, train, stage)
    per_micro = sum(terms.values())
    return {"per_microbatch": per_micro, "in_flight": micro, "kept": per_micro * micro, "recompute": recompute,
            "terms": terms}


def autocast_weight_copies(model: ModelConfig, train: Training, layout: Layout, rank: int) -> dict[str, float]:
    """bf16 copies of the matmul weights that autocast makes in forward and autograd keeps for backward (2 bytes
    each, the rank's tp shard whole: FSDP has gathered it): {"block": one block's, "head": the output
    projection's on the last stage}. A checkpointed block keeps none: its recomputation casts again."""
    if train.precision != "bf16-autocast":
        return {"block": 0.0, "head": 0.0}
    c = layout.coordinates(rank)
    d, hidden, tp = model.dim, model.hidden, layout.tp
    head = 2 * model.vocab_size * d / tp if c["pp"] == layout.pp - 1 else 0.0
    return {"block": 2 * (4 * d * d + 2 * d * hidden) / tp, "head": head}


def transient(model: ModelConfig, train: Training, layout: Layout, rank: int) -> dict[str, float]:
    """Buffers alive beside the model state and the activations at the peak: FSDP2's all-gathered compute copy of
    the current and the prefetched block, and the root's (never resharded after forward); DDP's gradient buckets
    (a copy of every gradient); the gradient of the logits."""
    c = layout.coordinates(rank)
    b = _dtype_bytes(train.precision)
    out = {}
    params = stage_parameters(model, layout, c["pp"])
    if layout.dp_shard > 1:
        sizes = {}
        for group, names in fsdp_groups([n for n, _, _ in params]).items():
            shapes = [tp_local_shape(s, d, layout.tp, c["tp"]) for n, s, d in params if n in names]
            sizes[group] = sum(-(-s[0] // layout.dp_shard) * layout.dp_shard * math.prod(s[1:]) for s in shapes)
        blocks = sorted((v for k, v in sizes.items() if k != "root"), reverse=True)
        out["FSDP gathered parameters"] = (sum(blocks[:2]) + sizes.get("root", 0)) * b["gathered"]
    elif layout.dp_replicate > 1:
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
            "send_recv": 1.0}[kind]


def communication(model: ModelConfig, train: Training, layout: Layout, rank: int = 0) -> list[dict]:
    """The collectives `rank` takes part in during one step, one record per (what, kind, group):
    calls, buffer bytes (the collective's logical buffer summed over calls: an all-gather's output, a
    reduce-scatter's input, an all-reduce's tensor, a point-to-point message) and bytes this rank sends on a ring.

    FSDP2: per micro-batch, each block's parameters are all-gathered in forward and again in backward (resharded
    after forward), the root's once (FSDP2 keeps the root gathered from forward to backward); the gradients are
    reduce-scattered once per step (set_requires_gradient_sync(False) on the other micro-batches), and across
    dp_replicate (HSDP) the reduced shards are all-reduced. DDP all-reduces every gradient once per step. Tensor
    parallelism with sequence parallelism: per block and micro-batch, forward all-gathers the normed input before
    attention and before the MLP and reduce-scatters both outputs; backward does the reverse (the same bytes). The
    pipeline sends each micro-batch's hidden states forward and their gradients back across each stage boundary.
    """
    c = layout.coordinates(rank)
    b = _dtype_bytes(train.precision)
    micro = train.grad_accum
    params = stage_parameters(model, layout, c["pp"])
    records = []

    def add(what, kind, group, size, calls, nbytes):
        if size > 1 and calls:
            records.append({"what": what, "kind": kind, "group": group, "group_size": size, "calls": calls,
                            "buffer_bytes": nbytes, "sent_bytes": nbytes * _ring_factor(kind, size)})

    groups = fsdp_groups([n for n, _, _ in params])
    padded = {}
    for group, names in groups.items():
        shapes = [tp_local_shape(s, d, layout.tp, c["tp"]) for n, s, d in params if n in names]
        padded[group] = sum(-(-s[0] // layout.dp_shard) * math.prod(s[1:]) for s in shapes)   # one rank's shard
    if layout.dp_shard > 1:
        s = layout.dp_shard
        blocks = [g for g in groups if g != "root"]
        gathers = micro * (2 * len(blocks) + ("root" in groups))
        gathered = micro * (2 * sum(padded[g] for g in blocks) + padded.get("root", 0)) * s * b["gathered"]
        add("FSDP parameters", "all_gather", "dp_shard", s, gathers, gathered)
        add("FSDP gradients", "reduce_scatter", "dp_shard", s, len(groups), sum(padded.values()) * s * b["reduce"])
        add("HSDP gradients", "all_reduce", "dp_replicate", layout.dp_replicate, len(groups),
            sum(padded.values()) * b["reduce"])
    elif layout.dp_replicate > 1:
        add("DDP gradients", "all_reduce", "dp_replicate", layout.dp_replicate, 1,
            model_state(model, train, layout, rank)["held"]["gradients"])
    if layout.tp > 1:
        n = train.batch_size * train.seq_len
        layers = len(stage_layers(model, layout.pp, c["pp"]))
        act = n * model.dim * b["residual"]
        add("TP sequence-parallel inputs", "all_gather", "tp", layout.tp, micro * layers * 2 * 2,
            micro * layers * 2 * 2 * act)
        add("TP sequence-parallel outputs", "reduce_scatter", "tp", layout.tp, micro * layers * 2 * 2,
            micro * layers * 2 * 2 * act)
    if layout.pp > 1:
        n = train.batch_size * train.seq_len
        msg = n * model.dim * b["residual"] / layout.tp
        sends = (c["pp"] < layout.pp - 1) + (c["pp"] > 0)
        add("pipeline activations and gradients", "send_recv", "pp", layout.pp, micro * sends, micro * sends * msg)
    return records


# ------------------------------------------------------------------------------------------------------ the time

def flops_per_step(model: ModelConfig, train: Training, layout: Layout, rank: int = 0) -> float:
    """Matmul FLOPs of one step on `rank`: 6 per token per weight of its stage's matmuls (2 forward, 4 backward),
    plus causal attention's 6 * s * D per token per layer (QK^T and AV, half the square each way), split by tp;
    checkpointing adds a forward of what it recomputes (full: every block; selective: every second block)."""
    c = layout.coordinates(rank)
    params = stage_parameters(model, layout, c["pp"])
    matmul_weights = sum(math.prod(s) for n, s, _ in params if len(s) == 2 and "embeddings" not in n)
    block_weights = sum(math.prod(s) for n, s, _ in params if n.startswith("layers.") and len(s) == 2)
    layers = len(stage_layers(model, layout.pp, c["pp"]))
    tokens = train.batch_size * train.seq_len * train.grad_accum
    attention = 2 * train.seq_len * model.dim * layers        # forward FLOPs per token, causal
    forward = 2 * matmul_weights + attention
    recomputed = {"none": 0.0, "full": 1.0, "selective": (layers // 2) / layers if layers else 0.0}
    blocks_forward = 2 * block_weights + attention
    return tokens * (3 * forward + recomputed[train.checkpointing] * blocks_forward) / layout.tp


def step_time(model: ModelConfig, train: Training, layout: Layout, ceilings: Ceilings, rank: int = 0) -> dict:
    """An estimate of one step's seconds from the ceilings, with its parts.

    Assumptions (shown with every plan): matmuls run at the measured matmul rate of the compute dtype; memory-bound
    work (the optimizer's pass over its states and the elementwise ops around the matmuls, counted as reading and
    writing each kept activation twice) at the copy rate; FSDP2's and DDP's collectives overlap with the compute of
    the other blocks except the first all-gather and the last reduction of a step (FSDP2 prefetches one block
    ahead; DDP reduces buckets while backward runs); tensor-parallel collectives sit on the critical path (no
    async TP); the pipeline idles (pp - 1) / (m + pp - 1) of the step (1F1B's bubble, m micro-batches); a group
    that spans nodes runs at the inter-node bus bandwidth.
    """
    compute_dtype = "fp32" if train.precision == "fp32" else "bf16"
    compute = flops_per_step(model, train, layout, rank) / ceilings.matmul[compute_dtype]
    state = model_state(model, train, layout, rank)["held"]
    act = activations(model, train, layout, rank)
    memory = (2 * sum(state.values()) + 4 * act["per_microbatch"] * train.grad_accum) / ceilings.copy
    overlapped = exposed = 0.0
    for r in communication(model, train, layout, rank):
        span = r["group_size"] * {"tp": 1, "dp_shard": layout.tp, "dp_replicate": layout.tp * layout.dp_shard,
                                  "pp": layout.tp * layout.dp}[r["group"]]
        bw = ceilings.busbw["intra" if span <= ceilings.gpus_per_node else "inter"]
        seconds = r["sent_bytes"] / bw + r["calls"] * ceilings.latency
        if r["group"] in ("tp", "pp"):
            exposed += seconds
        else:
            first_last = seconds / max(1, r["calls"])   # one call's worth is not hidden
            exposed += first_last
            overlapped += seconds - first_last
    busy = max(compute + memory, overlapped) + exposed
    bubble = (layout.pp - 1) / (train.grad_accum + layout.pp - 1) if layout.pp > 1 else 0.0
    total = busy / (1 - bubble)
    return {"seconds": total, "compute": compute, "memory": memory, "comm_overlapped": overlapped,
            "comm_exposed": exposed, "bubble": bubble, "ceilings": ceilings.source}


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
    """Raise ValueError for a layout the recipe refuses: heads, width or hidden not divisible by tp, layers by pp,
    fewer micro-batches than stages."""
    if min(layout.dp_replicate, layout.dp_shard, layout.tp, layout.pp) < 1:
        raise ValueError(f"every mesh dimension needs at least 1 rank: {layout}")
    if model.n_heads % layout.tp or model.dim % layout.tp or model.hidden % layout.tp:
        raise ValueError(f"tp={layout.tp} must divide the heads ({model.n_heads}), the width ({model.dim}) and the "
                         f"MLP's hidden size ({model.hidden})")
    if model.n_layers % layout.pp:
        raise ValueError(f"pp={layout.pp} must divide the layers ({model.n_layers})")
    if layout.pp > 1 and train.grad_accum < layout.pp:
        raise ValueError(f"pipelining over {layout.pp} stages needs at least as many micro-batches "
                         f"(grad_accum={train.grad_accum})")
    if model.dim % model.n_heads:
        raise ValueError(f"the width ({model.dim}) must divide into {model.n_heads} heads")
    if train.seq_len > model.max_seq_len:
        raise ValueError(f"seq_len {train.seq_len} exceeds the model's max_seq_len {model.max_seq_len}")


def plan(model: ModelConfig, train: Training, layout: Layout, ceilings: Ceilings | None = None,
         ranks: list[int] | None = None) -> Plan:
    """Bytes per rank (model state, activations, transient buffers, peak), rank 0's communication per step, and
    the step time when `ceilings` are given. `ranks`: which ranks to detail (default: every rank; the ranks of
    one tp x dp_shard slice of each stage differ only by FSDP's uneven last shards)."""
    check_layout(model, train, layout)
    rows = []
    for rank in (range(layout.world) if ranks is None else ranks):
        state = model_state(model, train, layout, rank)
        act = activations(model, train, layout, rank)
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
                    global_batch: int, batch_size: int = 1, optimizer: str = "adamw", precision: str = "bf16-fsdp",
                    checkpointing=CHECKPOINTING, max_tp: int = 8, headroom: float = 0.9) -> list[Plan]:
    """The layouts of `gpus` ranks (and checkpointing choices) whose peak fits `headroom` x `memory_bytes`, each
    at `global_batch` sequences per step, fastest estimate first.

    The accumulation follows from the layout: grad_accum = global_batch / (batch_size x data-parallel ranks);
    layouts that cannot split the batch so, tp above `max_tp` (one node's NVLink domain), or that the recipe
    refuses are left out. `headroom` keeps room for the allocator's cache and fragmentation, CUDA's context and
    NCCL's buffers, none of which the plan counts.
    """
    found = []
    for layout, ac in itertools.product(layouts(gpus), checkpointing):
        if layout.tp > max_tp or global_batch % (batch_size * layout.dp):
            continue
        train = Training(seq_len=seq_len, batch_size=batch_size, grad_accum=global_batch // (batch_size * layout.dp),
                         optimizer=optimizer, precision=precision if layout.dp_shard > 1 or precision != "bf16-fsdp"
                         else "bf16-autocast", checkpointing=ac)
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
    (HOST:29500 stands for the first node's address). `extra` adds flags (`steps=100` gives --steps 100)."""
    per_node = layout.world // nodes
    if nodes == 1:
        head = f"torchrun --standalone --nproc-per-node={per_node}"
    else:
        head = (f"torchrun --nnodes={nodes} --nproc-per-node={per_node} --rdzv-backend=c10d "
                "--rdzv-endpoint=HOST:29500 --rdzv-id=plan")
    flags = {"dp-replicate": layout.dp_replicate, "dp-shard": layout.dp_shard, "tp": layout.tp, "pp": layout.pp,
             "vocab-size": model.vocab_size, "dim": model.dim, "n-layers": model.n_layers, "n-heads": model.n_heads,
             "max-seq-len": model.max_seq_len, "seq-len": train.seq_len, "batch-size": train.batch_size,
             "grad-accum": train.grad_accum, "precision": train.precision, "ac": train.checkpointing,
             "optimizer": train.optimizer}
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
