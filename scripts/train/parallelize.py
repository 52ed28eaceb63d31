# From the PyTorch distributed cookbook: the cells tagged 'script:train/parallelize.py' in
#   notebooks/03_fsdp_and_device_mesh.ipynb
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
"""The named device mesh, and data parallelism as functions applied to the unchanged model of model.py: FSDP2 (and
HSDP), DDP, and gradient clipping over whatever the mesh shards.

Every parallelism of the recipe is such a function, taking the model and a mesh (or a slice of one) and changing
the model in place, in torchtitan's order: the pipeline split (pipeline.py), tensor parallel (tp.py), activation
checkpointing and compile (ac.py), then data parallel (here). The model's code never learns which were applied, and
its parameters keep their names (a checkpoint loads at any layout).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from config import MESH_DIMS, Layout

def build_mesh(world: int, dp_replicate: int, dp_shard: int, tp: int, pp: int, device_type: str,
               cfg=None, seq_len: int | None = None) -> DeviceMesh:
    """The named 4-D mesh ("pp", "dp_replicate", "dp_shard", "tp"), tp innermost (its ranks are neighbours: one
    node's fast links), pp outermost. Size-1 dimensions cost nothing and keep every layout one code path."""
    Layout(dp_replicate, dp_shard, tp, pp).check(world, cfg, seq_len)    # ValueError, one line, before any group
    return init_device_mesh(device_type, (pp, dp_replicate, dp_shard, tp), mesh_dim_names=MESH_DIMS)


def dp_rank_and_size(mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's index among the data-parallel replicas (dp_replicate x dp_shard), and their number: the ranks
    that must see different data."""
    shard = mesh["dp_shard"].size()
    return mesh.get_local_rank("dp_replicate") * shard + mesh.get_local_rank("dp_shard"), \
        mesh["dp_replicate"].size() * shard


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, param_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype | None = torch.float32, reshard_after_forward: bool = True,
               cpu_offload: bool = False, prefetch: bool = False, ignored_params: set | None = None) -> None:
    """FSDP2: `fully_shard` on each block, then on the root (embedding, final norm, output), bottom-up. A 1-D
    mesh shards over it; a 2-D (dp_replicate, dp_shard) mesh is HSDP (shard inside a group, replicate across).
    `param_dtype` bf16 computes in bf16 from fp32 master weights, with gradients reduced in `reduce_dtype`.
    `reshard_after_forward` False keeps every group's gathered weights from its forward to its backward (ZeRO-2's
    memory, one all-gather less per group and step); True frees them, the root's too (fully_shard's own default
    would keep the root's, which backward needs first: a trade the recipe makes for memory).
    `cpu_offload` keeps the shards, their gradients and the optimizer step in CPU memory. `prefetch` has block
    i's forward issue block i+1's all-gather, and block i+1's backward block i's (explicit, one block ahead).
    `ignored_params`: weights FSDP2 leaves as they are (neither sharded nor reduced), such as experts that expert
    parallelism already shares out over other ranks (notebook 08b)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype if param_dtype else None)
    offload = CPUOffloadPolicy(pin_memory=dp_mesh.device_type == "cuda") if cpu_offload else OffloadPolicy()
    blocks = list(model.layers.values())
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, offload_policy=offload,
                    reshard_after_forward=reshard_after_forward, ignored_params=ignored_params)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, offload_policy=offload,
                reshard_after_forward=reshard_after_forward, ignored_params=ignored_params)
    if prefetch:
        for current, following in zip(blocks, blocks[1:]):
            current.set_modules_to_forward_prefetch([following])
            following.set_modules_to_backward_prefetch([current])


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, device: torch.device) -> nn.Module:
    """Plain data parallel (replicas of the whole model, gradients all-reduced in buckets). Returns the wrapper:
    DDP is a module around the model (its state dict names are the model's, under `module.`; get_state_dict
    strips that). The only buffers are the rotary tables, computed alike on every rank: no broadcast per forward."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, process_group=dp_mesh.get_group(), broadcast_buffers=False,
                                   device_ids=[device.index] if device.type == "cuda" else None)


def clip_grad_norm_(parameters, max_norm: float, pp_mesh: DeviceMesh | None = None) -> torch.Tensor:
    """Clip the gradients of all parameters together and return their total norm. Works on DTensor gradients
    (FSDP2, TP: the norm of the pieces is reduced over the mesh), also on several meshes at once (experts on
    their own, notebook 08b: a foreach op takes one mesh, so each mesh's norm is taken apart, then combined); with
    a pipeline each stage has its own parameters, so the squared norms of the stages are summed over `pp_mesh`
    first (as torchtitan does)."""
    from torch.distributed.tensor import DTensor

    by_mesh = {}
    for p in parameters:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True) for group in by_mesh.values()]
    norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
    total = norms[0] if len(norms) == 1 else torch.stack(norms).norm()

    if pp_mesh is not None and pp_mesh.size() > 1:
        total = total ** 2
        dist.all_reduce(total, group=pp_mesh.get_group())
        total = total ** 0.5
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total
