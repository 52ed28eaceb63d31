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
- `SavedActivations`: the bytes autograd keeps for backward (the pack hook of `saved_tensors_hooks`), counted
  once per storage, parameters aside (they are held anyway). This is the "activation memory" that checkpointing
  trades for recomputation, and that data parallelism (DDP or FSDP) does not shard.
- `LiveSavedBytes`: the bytes autograd holds for backward at each moment, released when autograd drops them, and
  their peak: what a pipeline schedule keeps in flight (GPipe all micro-batches, 1F1B at most p - s on stage s).
Three jobs, three meters, one module.
"""
from __future__ import annotations

import functools
import weakref

import torch
from helpers.torch_private import TorchDispatchMode


def _tensors(tree) -> list:
    """The tensors in an op's arguments or result: nested lists, tuples and dict values (what ops hand over)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    return []


def _storages(tree) -> list:
    return [t.untyped_storage() for t in _tensors(tree) if t.device.type != "meta"]


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


class SavedActivations:
    """Counts the bytes autograd saves for backward during a forward pass, parameters excluded.

    Why: these are the activations, the part of training memory that data parallelism (DDP or FSDP) does not
    shard; they scale with the per-rank batch. Works on CPU, where no allocator statistic exists. A saved tensor
    is a parameter when it (or the tensor it is a view of, e.g. `weight.t()`) is an `nn.Parameter`, as FSDP2's
    unsharded parameters are too (testing "leaf that requires grad" would also catch inputs that require grad).
    Distinct storages count once, so views of one activation (q, k and v cut from one projection) count once. A
    DTensor (tensor parallelism) counts its local shard.

        meter = SavedActivations()
        with meter:
            loss = model(x, y)
        meter.bytes, meter.parameter_bytes, meter.tensors

    Inside a non-reentrant `torch.utils.checkpoint` region the checkpoint's own hook wins and keeps nothing, so
    nothing is counted there; the inputs the checkpoint keeps for recomputation it saves through these same
    hooks, outside its region, so they are counted.
    """

    def __init__(self):
        self._activations: dict[int, int] = {}
        self._parameters: dict[int, int] = {}
        self.tensors = 0  # tensors packed (a storage saved twice counts twice here, once in the bytes)
        self._hooks = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        target = self._parameters if isinstance(base, torch.nn.Parameter) else self._activations
        local = t
        if callable(getattr(t, "to_local", None)):  # a DTensor (tensor parallel): its storage is the local shard's
            with torch.no_grad():
                local = t.to_local()
        try:
            storage = local.untyped_storage()
            target[storage.data_ptr()] = storage.nbytes()
        except RuntimeError:  # FSDP2's gathered parameter under TP: a storage Python cannot read; count the tensor
            target[id(t)] = local.numel() * local.element_size()
        self.tensors += 1
        return t

    def __enter__(self) -> "SavedActivations":
        self._activations.clear()
        self._parameters.clear()
        self.tensors = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        """Bytes of activations saved for backward (distinct storages)."""
        return sum(self._activations.values())

    @property
    def parameter_bytes(self) -> int:
        """Bytes of parameters saved for backward (FSDP: the unsharded parameters of the groups in use)."""
        return sum(self._parameters.values())


def checkpointing_summary(ac: dict) -> str:
    """Notebook 05's `checkpointing_cost`, memory side, one line per checkpointing mode: the bytes saved for backward
    as autograd's hooks see them, the bytes alive at the end of forward, the peak of one step; then the closed form
    of what full checkpointing removes (each block's saved tensors but its input)."""
    mib = 2.0 ** 20
    lines = [f"{mode:<10} saved for backward {ac['saved_bytes'][mode] / mib:7.2f} MiB, alive after forward "
             f"{ac['held_bytes'][mode] / mib:7.2f} MiB, {ac['peak_label']} {ac['peak_bytes'][mode] / mib:7.2f} MiB"
             for mode in ac["saved_bytes"]]
    lines.append(f"full checkpointing removes exactly {ac['n_layers']} x (one block's {ac['one_block_saved'] / mib:.2f} "
                 f"MiB - its {ac['block_input_bytes'] / mib:.2f} MiB input)")
    return "\n".join(lines)


class _Saved:
    """What the pack hook hands autograd: the tensor, and a release of its bytes when autograd lets it go."""

    __slots__ = ("tensor", "_release")

    def __init__(self, tensor, release):
        self.tensor, self._release = tensor, release

    def __del__(self):
        self._release()


class LiveSavedBytes:
    """Bytes of tensors autograd holds for backward at one moment, and the peak, parameters excluded.

    A saved tensor is counted (its own elements, `numel * element_size`, so a micro-batch that is a view of the
    batch counts its part only) from the moment it is saved (the pack hook of `saved_tensors_hooks`) until
    autograd drops it (after the backward that used it, or when its graph is freed). A tensor saved by two ops
    counts twice: the measure is what each op keeps, identical for every micro-batch of one stage, so that a
    schedule's peak is an exact multiple of one micro-batch's. Works on CPU and counts activations only.

    Why not the other two meters of this module: `SavedActivations` adds up what a forward saves (each storage
    once, by its whole storage's bytes, never released), so GPipe and 1F1B, which save the same tensors in another
    order, read the same; `LiveTensorBytes` also counts gradients and temporaries, so a peak is no multiple of a
    micro-batch's saved bytes. A schedule's activation peak needs what is held at each moment, released when
    autograd drops it, counted by the saved tensor's own elements (a micro-batch is a view of the batch's storage).

        meter = LiveSavedBytes()
        with meter:
            schedule.step(...)
        meter.peak
    """

    def __init__(self):
        self.current = 0
        self.peak = 0
        self._hooks = None

    def _release(self, nbytes: int) -> None:
        self.current -= nbytes

    def _pack(self, t: torch.Tensor):
        base = t._base if t._base is not None else t
        if isinstance(base, torch.nn.Parameter) or t.device.type == "meta":
            return t
        nbytes = t.numel() * t.element_size()
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        return _Saved(t, functools.partial(self._release, nbytes))

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def __enter__(self) -> "LiveSavedBytes":
        self.current = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
