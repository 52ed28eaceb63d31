"""Bytes held per rank, and what ZeRO's arithmetic says they should be.

Why count tensors rather than read an allocator: on CPU there is no allocator statistic to read, and even on GPU
the allocator mixes parameters, gradients, optimizer state and activations. Counting the tensors each rank really
holds (the local shard of a DTensor, not its global shape) separates the three that ZeRO shards.
"""
from __future__ import annotations

import torch


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank stores: a DTensor's local shard, else the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def tensor_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = local_tensor(t)
    return t.numel() * t.element_size()


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """{'parameters', 'gradients', 'optimizer'} bytes held by this rank (optimizer state counted once per tensor)."""
    params = sum(tensor_bytes(p) for p in model.parameters())
    grads = sum(tensor_bytes(p.grad) for p in model.parameters())
    opt = 0
    if optimizer is not None:
        seen: set[int] = set()
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and id(value) not in seen and value.dim() > 0:
                    seen.add(id(value))
                    opt += tensor_bytes(value)
    return {"parameters": params, "gradients": grads, "optimizer": opt}


def zero_bytes_per_rank(num_params: int, world_size: int, stage: int, mixed_precision: bool = False,
                        optimizer_bytes_per_param: int = 8) -> dict[str, float]:
    """ZeRO's model-state arithmetic (Rajbhandari et al. 2020) for Adam, per rank.

    fp32 training: parameters 4Ψ, gradients 4Ψ, Adam moments 8Ψ = 16Ψ in all.
    Mixed precision: parameters 2Ψ, gradients 2Ψ, optimizer K=12 bytes (fp32 master copy + two moments) = 16Ψ.
    Stage 1 shards the optimizer state, stage 2 also the gradients, stage 3 (FSDP) also the parameters: /N.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    if mixed_precision:
        p, g, o = 2.0, 2.0, 12.0
    else:
        p, g, o = 4.0, 4.0, float(optimizer_bytes_per_param)
    n = float(world_size)
    return {"parameters": num_params * p / (n if stage >= 3 else 1),
            "gradients": num_params * g / (n if stage >= 2 else 1),
            "optimizer": num_params * o / (n if stage >= 1 else 1)}
