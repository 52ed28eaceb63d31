"""How many bytes a training step holds, measured the same way on CPU and GPU.

Why not read an allocator: on the CPU PyTorch keeps no allocator statistics (there is no
`torch.cuda.max_memory_allocated` for host memory), and process RSS mixes in the allocator's cache and Python.
Two honest measures instead:

- `LiveTensorBytes`: a TorchDispatchMode that sees every tensor an op creates inside the region (forward,
  backward and optimizer step alike, recomputation included) and watches its storage die. Its `peak` is the
  largest number of bytes of tensors created in the region and alive at one moment: activations, gradients,
  temporaries, optimizer state created on the first step. Tensors that existed before (parameters) are not
  counted. On a GPU it tracks `torch.cuda.max_memory_allocated` minus the baseline, without the allocator's
  rounding and fragmentation.
- `saved_tensor_bytes`: the bytes autograd keeps for backward (the pack hook of `saved_tensors_hooks`), counted
  once per storage. This is the "activation memory" that checkpointing trades for recomputation.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storages(tree) -> list:
    return [t.untyped_storage() for t in tree_flatten(tree)[0]
            if isinstance(t, torch.Tensor) and t.device.type != "meta"]


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of tensors created inside the `with` block and alive at the same time.

    A storage is counted when an op first returns it (outputs that alias an input, such as views and in-place
    results, allocate nothing) and uncounted when it is freed: PyTorch keeps one Python object per storage for
    as long as the storage lives, so a weakref finalizer on it fires exactly at the free.
    """

    def __init__(self):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, weakref.finalize] = {}

    def _release(self, key: int, nbytes: int) -> None:
        self.current -= nbytes
        self._live.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {id(s) for s in _storages((args, kwargs))}
        for storage in _storages(out):
            key = id(storage)
            if key in inputs or key in self._live:
                continue
            nbytes = storage.nbytes()
            self._live[key] = weakref.finalize(storage, self._release, key, nbytes)
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        return out

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        for fin in list(self._live.values()):
            fin.detach()  # stop watching: later frees must not touch this object
        self._live.clear()
        return result


@contextlib.contextmanager
def saved_tensor_bytes():
    """Count the bytes autograd saves for backward inside the block. Yields a dict filled on exit:
    {'bytes': total over distinct storages, 'tensors': how many tensors were packed}.

    Inside a non-reentrant `torch.utils.checkpoint` region the checkpoint's own hook wins and keeps nothing, so
    nothing is counted there; the inputs the checkpoint keeps for recomputation it saves through these same
    hooks, outside its region, so they are counted. Parameters saved by an op (a matmul saves its weight) count
    too: their storage is shared, not new, but autograd does hold it.
    """
    seen: dict[int, int] = {}
    result = {"bytes": 0, "tensors": 0}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        result["tensors"] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield result
    result["bytes"] = sum(seen.values())
