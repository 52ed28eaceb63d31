"""Bytes held per rank, and what ZeRO's arithmetic says they should be.

Why count tensors rather than read an allocator: on CPU there is no allocator statistic to read, and even on GPU
the allocator mixes parameters, gradients, optimizer state and activations. Counting the tensors each rank really
holds (the local shard of a DTensor, not its global shape) separates the three that ZeRO shards. What a step
holds besides (saved activations, peak live tensors) is measured in `helpers.measure.activations`.
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


def storage_bytes(tensors, round_to: int = 1) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor counts its local shard's storage).

    Why storages and not `numel`: what a rank really holds is its allocations. FSDP2 keeps each parameter's shard
    in a buffer padded to ceil(dim0 / N) rows and writes a step's sharded gradients into one reduce-scatter
    buffer per group, so the storages hold padding that `local.numel()` does not show. Views of one storage (all
    the gradients of an FSDP group) count once. `round_to=CUDA_BLOCK_BYTES` rounds each storage up the way the
    CUDA caching allocator does, for comparison with `torch.cuda.memory_allocated`.
    """
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = local_tensor(t).untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = -(-storage.nbytes() // round_to) * round_to
    return sum(seen.values())


def allocated_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                          round_to: int = 1) -> dict[str, int]:
    """Like `model_state_bytes`, but counting the storages this rank allocated (padding and shared buffers in)."""
    params = [p for p in model.parameters()]
    opt_tensors = []
    if optimizer is not None:
        for state in optimizer.state.values():
            opt_tensors += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"parameters": storage_bytes(params, round_to),
            "gradients": storage_bytes((p.grad for p in params), round_to),
            "optimizer": storage_bytes(opt_tensors, round_to)}


CUDA_BLOCK_BYTES = 512  # the CUDA caching allocator rounds every allocation up to a multiple of this


def cuda_memory(device) -> dict[str, int] | None:
    """{'allocated', 'peak'} bytes from the CUDA caching allocator for `device`; None off CUDA.

    Call it in a worker only (the kernel must never touch CUDA). `peak` is since the last
    `torch.cuda.reset_peak_memory_stats(device)`.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)   # frees on FSDP2's and NCCL's side streams complete before we read
    return {"allocated": torch.cuda.memory_allocated(device), "peak": torch.cuda.max_memory_allocated(device)}


def whole_parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters this rank holds whole (not as a DTensor shard) beyond its sharded state.

    Why: FSDP2 swaps a group's sharded DTensor parameters for all-gathered plain tensors while the group computes,
    and frees them when it reshards. Read between forward and backward, this is what `reshard_after_forward`
    decides: only the root's (default; the blocks resharded), or every group's (`False`, ZeRO-2-like). A model
    with no DTensor parameter (DDP, one process) holds its parameters whole as its state: 0 beyond it.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if not isinstance(model, FSDPModule):
        return 0
    return sum(tensor_bytes(p) for p in model.parameters() if not isinstance(p, DTensor))


def step_memory(build, loss_of, device, lr: float = 1e-3) -> dict:
    """What one rank holds for a training step of the model `build()` returns (DDP, FSDP or plain), with Adam.

    Runs in a worker. `loss_of(model)` runs the forward and returns the loss. A first step creates Adam's state;
    the second is measured: model state per part, held (a DTensor's own rows) and allocated (storages, FSDP2's
    padding in), the activations saved for backward (`SavedActivations`, parameters excluded), and the parameters
    held whole between forward and backward (`whole_parameter_bytes`). On a GPU also the CUDA allocator's view,
    above what was allocated before `build()`: allocated after a step, the peak during the next one, and the
    state rounded to the allocator's blocks. Everything it builds is freed when it returns.
    """
    from helpers.measure.activations import SavedActivations

    base = cuda_memory(device)
    model = build()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    loss_of(model).backward()
    optimizer.step()                                 # Adam's state now exists; gradients are kept
    steady = cuda_memory(device)
    if steady is not None:
        torch.cuda.reset_peak_memory_stats(device)
    with SavedActivations() as saved:
        loss = loss_of(model)
    whole = whole_parameter_bytes(model)
    loss.backward()
    optimizer.step()
    out = {"held": model_state_bytes(model, optimizer), "allocated": allocated_state_bytes(model, optimizer),
           "activations": saved.bytes, "whole_parameters": whole}
    if base is not None:
        out["cuda"] = {"steady": steady["allocated"] - base["allocated"],
                       "peak": cuda_memory(device)["peak"] - base["allocated"],
                       "state_rounded": sum(allocated_state_bytes(model, optimizer, CUDA_BLOCK_BYTES).values())}
    return out


SNAPSHOT_MAX_ENTRIES = 100_000  # allocator events kept; one step of notebook 03b's GPU model records a few thousand


def cuda_step_snapshot(build, loss_of, device, path: str) -> dict:
    """One training step recorded by the CUDA caching allocator; rank 0 writes the snapshot to `path`.

    Why: the byte counts above say how much; the snapshot says when and who. Dropped on
    https://pytorch.org/memory_viz (nothing is uploaded) its 'Active Memory Timeline' stacks every allocation of
    the step with the Python stack that made it. The second step is recorded, so Adam's state exists from its
    start. Python stacks only (`stacks="python"`): C++ frames would make the file several times larger and its
    dump slow (each frame is symbolised). Runs in a worker on a GPU; returns the step's peak allocated bytes, the
    model state's bytes (as the allocator rounds them), the events recorded and, on the rank that wrote it, the
    file's path and size (else None).
    """
    import os

    import torch.distributed as dist

    from helpers.torch_private import dump_memory_snapshot, memory_snapshot, record_memory_history

    device = torch.device(device)
    model = build()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    for step in range(2):
        if step == 1:
            torch.cuda.synchronize(device)
            record_memory_history(max_entries=SNAPSHOT_MAX_ENTRIES, stacks="python", device=device,
                                  clear_history=True)
            torch.cuda.reset_peak_memory_stats(device)
        loss_of(model).backward()
        optimizer.step()
        if step == 1:                                # the state as the peak saw it: gradients still held
            torch.cuda.synchronize(device)
            state = sum(allocated_state_bytes(model, optimizer, CUDA_BLOCK_BYTES).values())
        optimizer.zero_grad()
    writer = not dist.is_initialized() or dist.get_rank() == 0
    snapshot = memory_snapshot(device)
    events = sum(len(trace) for trace in snapshot["device_traces"])
    if writer:
        dump_memory_snapshot(path)
    record_memory_history(enabled=None, device=device)
    return {"peak": torch.cuda.max_memory_allocated(device), "state": state, "events": events,
            "path": path if writer else None, "file_bytes": os.path.getsize(path) if writer else None}
