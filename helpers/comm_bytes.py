"""What the collectives of a training step carry: op, dtype and bytes, recorded as they are issued.

Why a dispatch mode: FSDP2 issues its all-gathers and reduce-scatters through the c10d ops of the dispatcher, so a
TorchDispatchMode sees each one with its tensors, on any backend (gloo here, NCCL on GPUs), without patching
FSDP. That is how the notebook checks, against a closed form, that a MixedPrecisionPolicy really all-gathers
parameters in bf16 and reduce-scatters gradients in fp32. DDP's reducer calls the process group from C++ and is
not seen here: for DDP the notebook records the same facts in a communication hook (its public extension point).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_INPUT_ARGS = ("input_tensor", "input_tensors", "inputs", "tensors")
_OUTPUT_ARGS = ("output_tensor", "output_tensors", "outputs", "tensors")


@dataclass
class Collective:
    op: str           # e.g. "_allgather_base_", "_reduce_scatter_base_", "allreduce_"
    dtype: torch.dtype
    in_bytes: int     # bytes this rank contributes
    out_bytes: int    # bytes this rank receives into


def _bytes_of(value) -> tuple[int, torch.dtype | None]:
    tensors = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    dtype = tensors[0].dtype if tensors else None
    return sum(t.numel() * t.element_size() for t in tensors), dtype


class CollectiveLog(TorchDispatchMode):
    """Records every c10d collective issued inside the `with` block, in order, in `self.calls`."""

    def __init__(self):
        super().__init__()
        self.calls: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            named = dict(zip((a.name for a in func._schema.arguments), args))
            named.update(kwargs)
            in_bytes, dtype = _bytes_of([named[n] for n in _INPUT_ARGS if n in named][:1])
            out_bytes, _ = _bytes_of([named[n] for n in _OUTPUT_ARGS if n in named][:1])
            self.calls.append(Collective(func._schema.name.split("::")[-1], dtype, in_bytes, out_bytes))
        return func(*args, **kwargs)

    def summary(self) -> dict[tuple[str, str], dict[str, int]]:
        """{(op, dtype): {'calls', 'in_bytes', 'out_bytes'}} over everything recorded."""
        table: dict[tuple[str, str], dict[str, int]] = {}
        for c in self.calls:
            row = table.setdefault((c.op, str(c.dtype).replace("torch.", "")),
                                   {"calls": 0, "in_bytes": 0, "out_bytes": 0})
            row["calls"] += 1
            row["in_bytes"] += c.in_bytes
            row["out_bytes"] += c.out_bytes
        return table
