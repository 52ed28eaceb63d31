"""What FSDP2 should hold on each rank, parameter by parameter, with the padding ZeRO's 16Ψ/N leaves out.

Why a module: ZeRO's arithmetic (`helpers.measure.memory.zero_bytes_per_rank`) assumes Ψ divides evenly by N. FSDP2 does
not flatten parameters (FSDP1's FlatParameter did); it shards every parameter on dim 0 the way `torch.chunk` and
DTensor's `Shard(0)` do: every rank but the last few gets ceil(dim0 / N) rows, the rest get fewer or none. It then
keeps each shard in a buffer padded to ceil(dim0 / N) rows (so all-gather inputs have one size), and receives a
step's gradients in one padded reduce-scatter buffer per group. Adam's moments are `zeros_like` the unpadded
local shard. These functions give the exact bytes each rank should hold, so a notebook can assert equality
rather than closeness.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def padded_rows(dim0: int, world_size: int) -> int:
    """Rows of every rank's padded shard: ceil(dim0 / N)."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    return -(-dim0 // world_size)


def shard_rows(dim0: int, world_size: int, rank: int) -> int:
    """Rows rank `rank` owns under Shard(0) (torch.chunk semantics): ceil(dim0/N), fewer or none at the end."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    full = padded_rows(dim0, world_size)
    return max(0, min(full, dim0 - rank * full))


def _rest(shape: Sequence[int]) -> int:
    return math.prod(shape[1:]) if len(shape) > 1 else 1


def shard_numel(shapes: Iterable[Sequence[int]], world_size: int, rank: int) -> int:
    """Elements rank `rank` owns over all parameters (unpadded: what `DTensor.to_local().numel()` sums to)."""
    return sum(shard_rows(s[0], world_size, rank) * _rest(s) for s in shapes)


def padded_numel(shapes: Iterable[Sequence[int]], world_size: int) -> int:
    """Elements of every rank's padded shards over all parameters (the same on every rank)."""
    return sum(padded_rows(s[0], world_size) * _rest(s) for s in shapes)


def gathered_numel(model, world_size: int, blocks=None) -> tuple[int, int]:
    """(root, blocks): elements FSDP2 all-gathers for a model sharded per block and then at the root, once each:
    the root's own parameters, and all blocks' together. `blocks`: the modules sharded on their own (default: the
    recipe's `model.layers`, the ModuleDict `apply_fsdp` shards one by one). Each parameter counts as its unsharded
    buffer, dim 0 padded to a multiple of the world size (world x one rank's padded shard). Works on a meta-device
    model (shapes only)."""
    blocks_ = list(model.layers.values() if blocks is None else blocks)
    in_blocks = {id(p) for b in blocks_ for p in b.parameters()}
    root = world_size * padded_numel([p.shape for p in model.parameters() if id(p) not in in_blocks], world_size)
    gathered = sum(world_size * padded_numel([p.shape for p in b.parameters()], world_size) for b in blocks_)
    return root, gathered


def fsdp_state_bytes(shapes: Sequence[Sequence[int]], world_size: int, rank: int, param_bytes: int = 4,
                     grad_bytes: int = 4, optimizer_bytes: int = 8) -> dict[str, dict[str, int]]:
    """Exact per-rank bytes of parameters, gradients and Adam state under FSDP2 with a 1-D shard mesh of N ranks.

    Returns {'held': {...}, 'allocated': {...}}, each with 'parameters', 'gradients', 'optimizer':
    - held: the rank's own rows (DTensor local shards); summed over ranks it is exactly ZeRO's 16Ψ.
    - allocated: the storages behind them. Parameters and gradients live in buffers padded to ceil(dim0/N) rows
      on every rank; Adam's moments are allocated like the unpadded local shard.
    Defaults are fp32 parameters and gradients and Adam's two fp32 moments (4 + 4 + 8 = 16 bytes per parameter).
    For HSDP pass the size of the shard dimension as `world_size` and the rank's coordinate on it as `rank`.
    """
    shapes = [tuple(s) for s in shapes]
    own, padded = shard_numel(shapes, world_size, rank), padded_numel(shapes, world_size)
    return {"held": {"parameters": own * param_bytes, "gradients": own * grad_bytes,
                     "optimizer": own * optimizer_bytes},
            "allocated": {"parameters": padded * param_bytes, "gradients": padded * grad_bytes,
                          "optimizer": own * optimizer_bytes}}


def padding_numel(shapes: Sequence[Sequence[int]], world_size: int) -> int:
    """Elements of padding summed over all ranks: N * ceil(dim0/N) * rest - numel, per parameter."""
    return sum((world_size * padded_rows(s[0], world_size) - s[0]) * _rest(s) for s in shapes)
