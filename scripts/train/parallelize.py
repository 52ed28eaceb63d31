# From the PyTorch distributed cookbook: the cells tagged 'script:train/parallelize.py' in
#   notebooks/03_fsdp_and_device_mesh.ipynb
#   notebooks/05_mixed_precision.ipynb
#   notebooks/07_tensor_parallel_and_2d.ipynb
#   notebooks/08_pipeline_parallel.ipynb
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
"""Parallelism as functions applied to the unchanged GPT of model.py, in torchtitan's order: tensor parallel,
activation checkpointing, compile, then data parallel (FSDP2, HSDP or DDP); the pipeline split comes first of all.

Every function takes the model and a mesh (or a slice of one) and changes the model in place; the model's code
never learns which were applied, and its parameters keep their names (a checkpoint loads at any layout).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


def check_layout(world: int, dp_replicate: int, dp_shard: int, tp: int, pp: int, cfg=None,
                 seq_len: int | None = None) -> None:
    """Raise ValueError (one line) for a layout this world size or this model cannot take."""
    degrees = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp, "pp": pp}
    bad = [f"{name} {d}" for name, d in degrees.items() if d < 1]
    if bad:
        raise ValueError(f"parallel degrees must be at least 1, got {', '.join(bad)}")
    product = dp_replicate * dp_shard * tp * pp
    if product != world:
        raise ValueError(f"pp {pp} x dp_replicate {dp_replicate} x dp_shard {dp_shard} x tp {tp} = {product}, "
                         f"but the world size is {world}")
    if cfg is None:
        return
    if cfg.n_heads % tp:
        raise ValueError(f"tp {tp} must divide the {cfg.n_heads} attention heads (each rank takes whole heads)")
    if cfg.vocab_size % tp:
        raise ValueError(f"tp {tp} must divide the vocabulary size {cfg.vocab_size} (the output layer is split)")
    if cfg.n_layers % pp:
        raise ValueError(f"pp {pp} must divide the {cfg.n_layers} layers (equal stages)")
    if seq_len is not None and seq_len % tp:
        raise ValueError(f"tp {tp} must divide the sequence length {seq_len} (sequence parallel splits it)")


def build_mesh(world: int, dp_replicate: int, dp_shard: int, tp: int, pp: int, device_type: str,
               cfg=None, seq_len: int | None = None) -> DeviceMesh:
    """The named 4-D mesh ("pp", "dp_replicate", "dp_shard", "tp"), tp innermost (its ranks are neighbours: one
    node's fast links), pp outermost. Size-1 dimensions cost nothing and keep every layout one code path."""
    check_layout(world, dp_replicate, dp_shard, tp, pp, cfg, seq_len)
    return init_device_mesh(device_type, (pp, dp_replicate, dp_shard, tp), mesh_dim_names=MESH_DIMS)


def dp_rank_and_size(mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's index among the data-parallel replicas (dp_replicate x dp_shard), and their number: the ranks
    that must see different data."""
    shard = mesh["dp_shard"].size()
    return mesh.get_local_rank("dp_replicate") * shard + mesh.get_local_rank("dp_shard"), \
        mesh["dp_replicate"].size() * shard


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, param_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype | None = torch.float32, reshard_after_forward: bool = True,
               cpu_offload: bool = False, prefetch: bool = False) -> None:
    """FSDP2: `fully_shard` on each block, then on the root (embeddings, final norm, output), bottom-up. A 1-D
    mesh shards over it; a 2-D (dp_replicate, dp_shard) mesh is HSDP (shard inside a group, replicate across).
    `param_dtype` bf16 computes in bf16 from fp32 master weights, with gradients reduced in `reduce_dtype`.
    `reshard_after_forward` False keeps every group's gathered weights from its forward to its backward (ZeRO-2's
    memory, one all-gather less per group and step); True frees them, the root's too (fully_shard's own default
    would keep the root's, which backward needs first: a trade the recipe makes for memory).
    `cpu_offload` keeps the shards, their gradients and the optimizer step in CPU memory. `prefetch` has block
    i's forward issue block i+1's all-gather, and block i+1's backward block i's (explicit, one block ahead)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype if param_dtype else None)
    offload = CPUOffloadPolicy(pin_memory=dp_mesh.device_type == "cuda") if cpu_offload else OffloadPolicy()
    blocks = list(model.layers.values())
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, offload_policy=offload,
                    reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, offload_policy=offload,
                reshard_after_forward=reshard_after_forward)
    if prefetch:
        for current, following in zip(blocks, blocks[1:]):
            current.set_modules_to_forward_prefetch([following])
            following.set_modules_to_backward_prefetch([current])


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, device: torch.device) -> nn.Module:
    """Plain data parallel (replicas of the whole model, gradients all-reduced in buckets). Returns the wrapper:
    DDP is a module around the model (its state dict names are the model's, under `module.`; get_state_dict
    strips that)."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, process_group=dp_mesh.get_group(),
                                   device_ids=[device.index] if device.type == "cuda" else None)


# activation checkpointing and compile: taught in notebook 05
import functools

import torch
from torch import nn


def apply_compile(model: nn.Module, backend="inductor") -> None:
    """torch.compile each block (as torchtitan does: the blocks are alike, so one compiled graph serves them all),
    before FSDP2, so its hooks stay outside the compiled graphs. The compiled block is a wrapper whose parameter
    names gain `_orig_mod.`; get_state_dict (and so every checkpoint) and init_weights drop it. `backend`: any
    torch.compile backend (notebook 07 passes one that counts the graphs it is handed)."""
    for name, block in model.layers.named_children():
        model.layers.register_module(name, torch.compile(block, fullgraph=True, backend=backend))


def _selective_policy():
    """Per-op selective checkpointing: keep the outputs of the matmuls and of attention (costly to recompute),
    recompute the rest (norms, GELU, adds: cheap, and their outputs are as large)."""
    from torch.ops import aten  # not torch.ops.aten: cloudpickle (notebook 05's workers) cannot pickle torch.ops
    from torch.utils.checkpoint import CheckpointPolicy

    save = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.linear.default,
            aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_attention_math.default}
    for name in ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        if hasattr(aten, name):
            save.add(getattr(aten, name).default)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def apply_ac(model: nn.Module, mode: str) -> None:
    """Activation checkpointing per block: "full" keeps only each block's input and recomputes the block in the
    backward; "selective" keeps the matmuls' and attention's outputs and recomputes the rest (per op, through
    torch.utils.checkpoint's create_selective_checkpoint_contexts); "alternate" checkpoints every other block
    whole. The block's forward is wrapped in place (not the module), so parameter names do not change."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    if mode == "none":
        return
    if mode not in ("full", "selective", "alternate"):
        raise ValueError(f"activation checkpointing mode {mode!r}: use none, full, selective or alternate")
    context_fn = None
    if mode == "selective":
        context_fn = functools.partial(create_selective_checkpoint_contexts, _selective_policy())
    for name, block in model.layers.items():
        if mode == "alternate" and int(name) % 2:
            continue
        block.forward = _checkpointed(block.forward, checkpoint, context_fn)


def _checkpointed(forward, checkpoint, context_fn):
    """forward run under torch.utils.checkpoint. A function of our own, not functools.partial(checkpoint, ...):
    torch.compile skips frames of torch's own files, so the compiled block must enter through code of ours, where
    it sees the checkpoint call and traces it."""
    options = {"context_fn": context_fn} if context_fn else {}

    def checkpointed_forward(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **options, **kwargs)
    return checkpointed_forward


# tensor parallel, and clipping across every mesh dimension: taught in notebook 07
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool = True, sequence_parallel: bool = True) -> None:
    """Megatron-style tensor parallel: wq/wk/wv and w1 split by output features (ColwiseParallel), wo and w2 by
    input features (RowwiseParallel) so each block needs one reduction per half; the embedding tables and the
    output layer split over their rows (vocabulary, positions). With `sequence_parallel` the residual stream
    between the blocks is split along the sequence (Shard(1)) and the norms work on their piece (SequenceParallel):
    each all-reduce becomes a reduce-scatter, and an all-gather where the whole sequence is needed. With
    `loss_parallel` the logits stay split over the vocabulary and the loss must run inside
    `torch.distributed.tensor.parallel.loss_parallel()` (see train.py)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    between = Shard(1) if sequence_parallel else Replicate()      # the residual stream between the split layers
    top = {"norm": SequenceParallel(),
           "output": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                     use_local_output=not loss_parallel)}
    if model.tok_embeddings is not None:
        # each rank looks up its rows of the tables; the sum of the pieces is reduced (with SP: scattered along the
        # sequence, a reduce-scatter)
        top |= {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
                "pos_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between)}
    if model.norm is None or not sequence_parallel:
        top.pop("norm")
    if model.norm is None:
        top.pop("output")
    parallelize_module(model, tp_mesh, top)
    # the input as one DTensor per attention and feed-forward (all-gathered from the sequence shards with SP): wq,
    # wk and wv then add their partial input gradients before a single reduction, as Megatron's fused qkv does
    gather = PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),))
    norms = {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()} if sequence_parallel else {}
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            **norms,
            "attention": gather,
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=between),
            "feed_forward": gather,
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=between),
        })


def clip_grad_norm_(parameters, max_norm: float, pp_mesh: DeviceMesh | None = None) -> torch.Tensor:
    """Clip the gradients of all parameters together and return their total norm. Works on DTensor gradients
    (FSDP2, TP: the norm of the pieces is reduced over the mesh); with a pipeline each stage has its own
    parameters, so the squared norms of the stages are summed over `pp_mesh` first (as torchtitan does)."""
    from torch.distributed.tensor import DTensor

    parameters = [p for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in parameters], foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if pp_mesh is not None and pp_mesh.size() > 1:
        total = total ** 2
        dist.all_reduce(total, group=pp_mesh.get_group())
        total = total ** 0.5
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total, foreach=True)
    return total


# the pipeline split: taught in notebook 08
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def _stage_index(pp_mesh: DeviceMesh, chunk: int, chunks: int) -> tuple[int, int]:
    """(this stage's index, the number of stages): with `chunks` stages per rank, rank r of p holds stages r,
    r + p, ..., so the interleaved schedule's stages on one rank are not neighbours."""
    return pp_mesh.get_local_rank() + chunk * pp_mesh.size(), chunks * pp_mesh.size()


def pipeline_split(model: nn.Module, pp_mesh: DeviceMesh, chunk: int = 0, chunks: int = 1) -> nn.Module:
    """Keep this rank's stage of the model, before any other parallelism is applied: equal numbers of blocks, the
    first stage also the embeddings, the last the final norm and output. Blocks keep their names, so the stages'
    state dicts together are the whole model's. For the interleaved schedule, split one copy per `chunk`."""
    stage, n_stages = _stage_index(pp_mesh, chunk, chunks)
    names = list(model.layers)
    if len(names) % n_stages:      # else some blocks would silently belong to no stage
        raise ValueError(f"{len(names)} layers do not split into {n_stages} equal stages")
    per = len(names) // n_stages
    mine = set(names[stage * per:(stage + 1) * per])
    for name in names:
        if name not in mine:
            del model.layers[name]
    if stage != 0:
        model.tok_embeddings = model.pos_embeddings = None
    if stage != n_stages - 1:
        model.norm = model.output = None
    return model


def pipeline_stage(model: nn.Module, pp_mesh: DeviceMesh, device: torch.device, chunk: int = 0, chunks: int = 1):
    """The PipelineStage of a split, parallelized and materialized model (the stage sends and receives the
    activations between neighbouring ranks of `pp_mesh`; their shapes are found at the first step)."""
    from torch.distributed.pipelining import PipelineStage

    stage, n_stages = _stage_index(pp_mesh, chunk, chunks)
    return PipelineStage(model, stage, n_stages, device, group=pp_mesh.get_group())


def pipeline_schedule(stage, name: str, n_microbatches: int, loss_fn):
    """GPipe (all forwards, then all backwards) or 1F1B (one forward, one backward: fewer activations alive) on a
    stage; "interleaved" (1F1B over several stages per rank: a smaller bubble) on the list of this rank's stages.
    Each averages the micro-batches' gradients (scale_grads)."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}[name]
    return cls(stage, n_microbatches=n_microbatches, loss_fn=loss_fn)
