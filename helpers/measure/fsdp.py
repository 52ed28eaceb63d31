"""FSDP2 held to what it should do: the bytes each rank holds, the activations a precision policy saves by dtype, and
what the bf16 policy costs on one GPU. Notebooks 03, 03b and 05 call these; what a reader copies (`fully_shard`, the
policy, the step, the training beside one process) stays in their cells and in the recipe.

Shards, to the byte (`fsdp_state_bytes` and the functions before it). ZeRO's arithmetic
(`helpers.measure.memory.zero_bytes_per_rank`) assumes Ψ divides evenly by N. FSDP2 does not flatten parameters
(FSDP1's FlatParameter did); it shards every parameter on dim 0 the way `torch.chunk` and DTensor's `Shard(0)` do:
every rank but the last few gets ceil(dim0 / N) rows, the rest get fewer or none. It then keeps each shard in a
buffer padded to ceil(dim0 / N) rows (so all-gather inputs have one size), and receives a step's gradients in one
padded reduce-scatter buffer per group. Adam's moments are `zeros_like` the unpadded local shard. These functions
give the exact bytes each rank should hold, so a notebook can assert equality rather than closeness.

Activations by dtype (`SavedByDtype`, a meter notebook 03b's `policy_report` is handed). Not every op computes in
a bf16 policy's dtype: RMSNorm upcasts to fp32, and where it runs as separate ops, as on the CPU, autograd saves its
fp32 intermediates. What shrinks to half is the bf16 part, which this meter's split by dtype shows. (The lockstep
training beside one process and the policy report themselves are the notebooks' cells: 03 and 03b.)

What the bf16 policy costs at world size 1 on a GPU (`CONFIGS`, `with_ratios`, `eager_ratios`, `against_target`):
the configurations notebook 03b's worker `bf16_step_times` times, and the ratios read from its result. With one GPU
FSDP2 shards over a mesh of one rank, so there is no communication, but each block's bf16 weights are still cast
and copied into their unsharded buffers before its forward and, resharded, again before its backward, its gradients
are copied into a reduce-scatter buffer and cast to the reduce dtype, and Adam steps DTensors; plain
`torch.autocast` on the unwrapped model casts per op instead. The knobs (`reshard_after_forward=False`, explicit
prefetch, `torch.compile` per block before `fully_shard`: the recipe's `apply_compile`) are what notebooks 03, 03b
and 05 teach. Every configuration is built and warmed up first (torch.compile compiles during the warm-up, never
inside a timed step); then each round times one step of every configuration in turn, so a slow phase of the
machine falls on all of them alike, and each configuration's ratio to its baseline is taken round by round (a ratio
taken side by side, with its spread). A compiled FSDP2 configuration is compared with the compiled plain model too:
compile speeds both up, and the fair question is what FSDP2 costs at equal compilation. Timings are shown with
their spread and judged only against the project's goal (`against_target`): they depend on the GPU, the model size
and the load.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from helpers.measure.activations import SavedActivations


# ------------------------------------------------------------------------------------------------- shards, to the byte
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


# ---------------------------------------------------------------------------------------------- activations by dtype
class SavedByDtype(SavedActivations):
    """`SavedActivations` that also sums the saved bytes per dtype (`by_dtype`), each storage counted once."""

    def __init__(self):
        super().__init__()
        self._dtypes: dict[int, str] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        local = t
        if callable(getattr(t, "to_local", None)):  # a DTensor: its storage is the local shard's
            with torch.no_grad():
                local = t.to_local()
        try:
            key = local.untyped_storage().data_ptr()
        except RuntimeError:  # a storage Python cannot read: SavedActivations keys it by id, as here
            key = id(t)
        self._dtypes[key] = str(t.dtype)
        return super()._pack(t)

    @property
    def by_dtype(self) -> dict[str, int]:
        """{dtype: bytes} of the activations saved (parameters excluded), largest first."""
        out: dict[str, int] = {}
        for key, nbytes in self._activations.items():
            out[self._dtypes[key]] = out.get(self._dtypes[key], 0) + nbytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


# ------------------------------------------------------------------------------- what the bf16 policy costs on one GPU
EAGER_BASE, COMPILED_BASE = "bf16 autocast, no FSDP", "bf16 autocast + compile, no FSDP"

# label: what is applied. fsdp False: the unwrapped model under torch.autocast; fsdp True: the recipe's apply_fsdp with
# a bf16 param_dtype. The eager FSDP2 rows add one knob each to its defaults; the compiled row adds all of them
# together. Compilation is what costs time on a GPU (each compiled configuration compiles its blocks' forward and
# backward), so there is one compiled FSDP2 row, not one per knob.
CONFIGS = {
    EAGER_BASE: {"fsdp": False},
    "FSDP2 bf16 policy, defaults": {"fsdp": True},
    "FSDP2 + reshard_after_forward=False": {"fsdp": True, "reshard_after_forward": False},
    "FSDP2 + explicit prefetch": {"fsdp": True, "prefetch": True},
    COMPILED_BASE: {"fsdp": False, "compile": True},
    "FSDP2 + all three knobs, compiled": {"fsdp": True, "reshard_after_forward": False, "prefetch": True,
                                          "compile": True},
}


def base_of(label: str, configs: dict = CONFIGS) -> list[str]:
    """The baselines a configuration's step is divided by: the eager autocast step, and for a compiled
    configuration the compiled autocast step as well (when that baseline is among `configs`)."""
    bases = [EAGER_BASE] if label != EAGER_BASE else []
    if configs[label].get("compile") and label != COMPILED_BASE and COMPILED_BASE in configs:
        bases.append(COMPILED_BASE)
    return bases


def with_ratios(bench: dict, configs: dict = CONFIGS) -> dict:
    """Notebook 03b's `bf16_step_times` result with 'ratios': {label: {base: [step / base's step, round by round]}}
    for every configuration that ran, against each of its baselines that ran (`base_of`): ratios taken side by side."""
    seconds = bench["seconds"]
    ratios = {label: {base: [t / b for t, b in zip(seconds[label], seconds[base])]
                      for base in base_of(label, configs) if isinstance(seconds.get(base), list)}
              for label in configs if isinstance(seconds.get(label), list)}
    return {**bench, "ratios": ratios}


def eager_ratios(bench: dict) -> dict[str, dict[str, float | tuple[float, float]]]:
    """Each FSDP2 configuration's step over the plain eager autocast step (`with_ratios`' result; configurations
    that failed are left out): the median, min and max of the rounds' ratios, and the 90% bootstrap interval of the
    median (`advice.median_interval`), the spread a verdict on a target takes."""
    import statistics

    from helpers.measure.advice import median_interval

    out = {}
    for label, by_base in bench["ratios"].items():
        rounds = sorted(by_base.get(EAGER_BASE, []))
        if CONFIGS.get(label, {}).get("fsdp", label.startswith("FSDP")) and rounds:
            out[label] = {"median": statistics.median(rounds), "min": rounds[0], "max": rounds[-1],
                          "interval": median_interval(rounds)}
    return out


def against_target(ratio: dict, target: float) -> str:
    """'within', 'above' or 'inconclusive' for a ratio (`eager_ratios`' entry) against a target ceiling: the median's
    interval decides, so a spread that straddles the target says so instead of picking a side."""
    low, high = ratio["interval"]
    if high <= target:
        return f"within {target}x"
    if low > target:
        return f"above {target}x"
    return f"inconclusive (the interval straddles {target}x)"
