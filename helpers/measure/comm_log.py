"""Record the collectives a training step issues: kind, dtype, size and group, as they are issued.

Why a dispatch mode: FSDP2 issues its all-gathers and reduce-scatters through the c10d ops of the dispatcher, and
DDP's C++ reducer issues its bucket all-reduce there too, so a TorchDispatchMode sees each call with its tensors, on
any backend (gloo here, NCCL on GPUs), without patching either. It also sees functional collectives (DTensor's
redistribute). That is how the notebooks check against closed forms the number and size of FSDP2's collectives
(03) and that a MixedPrecisionPolicy all-gathers in bf16 and reduce-scatters in fp32 (05).

Why beside `torch.distributed.tensor.debug.CommDebugMode`: that mode counts collectives per kind (and per module),
which is what a notebook should show, but keeps sizes only for DTensor arguments, while FSDP2 and DDP issue plain
c10d collectives on flat buffers.

Sizes are the collective's logical buffer: an all-gather's output, a reduce-scatter's input, an all-reduce's
tensor. On a ring, each rank then sends (N-1)/N of that buffer for an all-gather or a reduce-scatter, and twice
that for an all-reduce (nccl-tests' busbw factors, `helpers.measure.collectives.busbw_factor`).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from helpers import torch_private
from helpers.measure.collectives import busbw_factor
from helpers.torch_private import TorchDispatchMode

ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE = "all_gather", "reduce_scatter", "all_reduce"

# c10d op name -> (kind, index of the argument that holds the logical buffer)
_C10D = {
    "_allgather_base_": (ALL_GATHER, 0), "allgather_": (ALL_GATHER, 0), "allgather_coalesced_": (ALL_GATHER, 0),
    "allgather_into_tensor_coalesced_": (ALL_GATHER, 0),
    "_reduce_scatter_base_": (REDUCE_SCATTER, 1), "reduce_scatter_": (REDUCE_SCATTER, 1),
    "reduce_scatter_tensor_coalesced_": (REDUCE_SCATTER, 1),
    "allreduce_": (ALL_REDUCE, 0), "allreduce_coalesced_": (ALL_REDUCE, 0),
    "broadcast_": ("broadcast", 0), "alltoall_": ("all_to_all", 1), "alltoall_base_": ("all_to_all", 1),
    "send": ("send", 0), "recv_": ("recv", 0),   # point to point: a pipeline's activations and their gradients
}
_FUNCTIONAL = {
    "all_gather_into_tensor": ALL_GATHER, "all_gather_into_tensor_coalesced": ALL_GATHER,
    "reduce_scatter_tensor": REDUCE_SCATTER, "reduce_scatter_tensor_coalesced": REDUCE_SCATTER,
    "all_reduce": ALL_REDUCE, "all_reduce_coalesced": ALL_REDUCE, "broadcast": "broadcast",
    "all_to_all_single": "all_to_all",
}


@dataclass(frozen=True)
class Collective:
    kind: str        # all_gather, reduce_scatter, all_reduce, broadcast, all_to_all, send, recv
    numel: int       # elements of the logical buffer (see the module docstring)
    itemsize: int    # bytes per element
    group_size: int  # ranks taking part
    dtype: str = ""  # of the buffer on the wire, e.g. "bfloat16"
    op: str = ""     # the op as dispatched, e.g. "_allgather_base_" (c10d) or "all_reduce" (functional)

    @property
    def bytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def ring_bytes_sent(self) -> float:
        """Bytes one rank sends for this collective on a ring: the buffer times nccl-tests' busbw factor (a
        broadcast: the whole buffer, pipelined); nothing in a group of one."""
        if self.group_size <= 1 or self.kind == "recv":
            return 0.0
        if self.kind == "send":
            return float(self.bytes)
        return self.bytes * busbw_factor(self.kind, self.group_size)


def _tensors(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _group_size(args, functional: bool, name: str) -> int:
    if functional:
        if name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_into_tensor_coalesced",
                    "reduce_scatter_tensor_coalesced"):
            return int(next(a for a in args if isinstance(a, int)))
        import torch.distributed as dist

        return dist.get_world_size(torch_private.resolve("resolve_process_group")(args[-1]))
    import torch.distributed as dist

    for a in args:
        if isinstance(a, torch.ScriptObject):  # a c10d op carries its ProcessGroup boxed as a ScriptObject
            try:
                return dist.ProcessGroup.unbox(a).size()
            except Exception:  # noqa: BLE001 - a ReduceOp or another boxed object
                continue
    return 0


class CollectiveLog(TorchDispatchMode):
    """A dispatch mode that records every collective issued while it is active.

        log = CollectiveLog()
        with log:
            model(x, y).backward()
        log.counts()            # {'all_gather': 5, 'reduce_scatter': 3}
        log.numel('all_gather') # elements gathered in all
        log.summary()           # {'all_gather': {'calls', 'numel', 'bytes', 'group_sizes', 'dtypes'}, ...}
    """

    def __init__(self):
        super().__init__()
        self.calls: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor turn itself into plain collectives first; we see those
        out = func(*args, **kwargs)
        packet = getattr(func, "_overloadpacket", None)
        namespace = getattr(packet, "_qualified_op_name", "").split("::")[0]
        name = getattr(packet, "__name__", "")
        if namespace == "c10d" and name in _C10D:
            kind, index = _C10D[name]
            tensors = _tensors(args[index])
            self._record(kind, name, tensors, _group_size(args, False, name))
        elif namespace == "_c10d_functional" and name in _FUNCTIONAL:
            kind = _FUNCTIONAL[name]
            tensors = _tensors(args[0])
            size = _group_size(args, True, name)
            numel_factor = size if kind == ALL_GATHER else 1  # the input is one rank's part of the output
            self._record(kind, name, tensors, size, numel_factor)
        return out

    def _record(self, kind: str, op: str, tensors: list, group_size: int, numel_factor: int = 1) -> None:
        if tensors:
            self.calls.append(Collective(kind, numel_factor * sum(t.numel() for t in tensors),
                                         tensors[0].element_size(), group_size,
                                         str(tensors[0].dtype).replace("torch.", ""), op))

    def counts(self) -> dict[str, int]:
        """Calls per kind."""
        return dict(Counter(c.kind for c in self.calls))

    def numel(self, kind: str) -> int:
        """Elements moved by all calls of one kind (each call's logical buffer)."""
        return sum(c.numel for c in self.calls if c.kind == kind)

    def bytes(self, kind: str | None = None) -> int:
        return sum(c.bytes for c in self.calls if kind is None or c.kind == kind)

    def ring_bytes_sent(self, kind: str | None = None) -> float:
        """Bytes one rank sends on a ring for all calls (of one kind)."""
        return sum(c.ring_bytes_sent for c in self.calls if kind is None or c.kind == kind)

    def summary(self) -> dict[str, dict]:
        """{kind: {'calls', 'numel', 'bytes', 'group_sizes', 'dtypes'}}, plain Python for a worker's return value.

        'group_sizes' and 'dtypes' list the distinct values seen, in the order first seen."""
        out: dict[str, dict] = {}
        for c in self.calls:
            entry = out.setdefault(c.kind, {"calls": 0, "numel": 0, "bytes": 0, "group_sizes": [], "dtypes": []})
            entry["calls"] += 1
            entry["numel"] += c.numel
            entry["bytes"] += c.bytes
            if c.group_size not in entry["group_sizes"]:
                entry["group_sizes"].append(c.group_size)
            if c.dtype not in entry["dtypes"]:
                entry["dtypes"].append(c.dtype)
        return out


def collectives_of_step(model, step, warmup: int = 2) -> dict:
    """The collectives one training step of `model` issues, counted two ways. Runs in a worker.

    `step(model)` runs forward and backward. `warmup` steps run first: in its second step DDP rebuilds its buckets
    in the order gradients arrived (rank 0 broadcasts the new layout), and the steady state is what we count.
    Returns plain values: 'counts' ({op: calls}, from `CommDebugMode`), 'log' (`CollectiveLog.summary()`),
    'ring_bytes' ({kind: bytes this rank sends on a ring}) and 'forward_gathers' ({module name: all-gathers
    issued inside that module's forward}, CommDebugMode's per-module view: where explicit prefetch moves them).
    """
    import warnings

    from torch.distributed.tensor.debug import CommDebugMode

    # CommDebugMode's module tracker adds hooks that make outputs views and fire full backward hooks on modules
    # whose inputs need no grad; neither warning concerns the model.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    for _ in range(warmup):
        step(model)
    comm, log = CommDebugMode(), CollectiveLog()
    with comm, log:
        step(model)
    forward_gathers = {name: sum(n for op, n in counts.get("forward", {}).items() if "allgather" in str(op))
                       for name, counts in comm.comm_module_counts.items()}
    return {"counts": {str(op): n for op, n in comm.get_comm_counts().items()}, "log": log.summary(),
            "ring_bytes": {kind: log.ring_bytes_sent(kind) for kind in log.counts()},
            "forward_gathers": forward_gathers}
