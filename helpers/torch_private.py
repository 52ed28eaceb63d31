"""The private torch APIs the project uses, in one place: why no public API does the job, and a check by name.

Why a module: a private name (a leading underscore) may change or vanish in any torch release, without notice.
Each one the project needs is named here once, with the reason no public API serves. The helpers take it from here
(`from helpers.torch_private import TorchDispatchMode`, `torch_private.resolve("rendezvous_handlers")`).
`tests/project/test_private_names.py` resolves every entry, so a torch release that removes one fails a test that names it
and its users, rather than a notebook half-way through; and it checks that no file of the project (helpers, tools,
the notebooks' cells, scripts, benchmarks) reaches a private torch name other than here.

The allowed exceptions (`named_in`): a notebook's worker is plain PyTorch that would run under torchrun unchanged,
so it imports nothing from `helpers`, and scripts/ imports torch and the standard library only; where such code
needs a private API it writes the name out itself, and where the lesson is the call (notebook 05's memory snapshot,
09b's flight-recorder dump) the reader must see it. An entry lists those files, and the guard lets each of them
name that entry's API and no other private one.
"""
from __future__ import annotations

import importlib
from typing import NamedTuple


class PrivateAPI(NamedTuple):
    module: str
    attribute: str  # dotted names are looked up one after the other from the module
    used_by: str
    why: str
    named_in: tuple[str, ...] = ()  # files that name it themselves, relative to the repository: see above


_SDPA_OPS = ("selective activation checkpointing's policy matches op overloads, and ATen names its attention kernels "
             "(what scaled_dot_product_attention dispatches to) with a leading underscore; torchtitan's policy saves "
             "the same ops by the same names")
_RECIPE_AC = ("scripts/train/ac.py (apply_ac's ops to save: a recipe module, torch only), made of "
              "notebooks/05_mixed_precision.ipynb's cells")


PRIVATE = {
    "TorchDispatchMode": PrivateAPI(
        "torch.utils._python_dispatch", "TorchDispatchMode",
        "helpers/measure/comm_log.py (CollectiveLog), helpers/measure/activations.py (LiveTensorBytes)",
        "a mode that sees every op the dispatcher runs, with its tensors (c10d collectives issued from C++ by DDP's "
        "reducer and FSDP2, each tensor an op creates); torch exports TorchDispatchMode only from this module. "
        "Public modes (torch.overrides.TorchFunctionMode) see Python-level calls only."),
    "rendezvous_handlers": PrivateAPI(
        "torch.distributed.rendezvous", "_rendezvous_handlers",
        "helpers/launcher/rendezvous.py (env:// answered by a FileStore)",
        "the public register_rendezvous_handler refuses a scheme that is registered already, and env:// always is; "
        "a launch's ranks call a plain init_process_group(), so only replacing env:// keeps them off the network"),
    "resolve_process_group": PrivateAPI(
        "torch.distributed.distributed_c10d", "_resolve_process_group",
        "helpers/measure/comm_log.py (the group size of a functional collective)",
        "a functional collective (DTensor's redistribute) carries its group by name; no public API maps a group "
        "name to its ProcessGroup"),
    "record_memory_history": PrivateAPI(
        "torch.cuda.memory", "_record_memory_history",
        "helpers/measure/memory.py (cuda_step_snapshot), notebook 05's worker memory_snapshot (the lesson), "
        "scripts/train/measure.py's --memory-snapshot (notebook 09's cells: a recipe module, torch only)",
        "the allocator's event history behind a memory snapshot: documented in 'Understanding CUDA Memory Usage', "
        "but only under this name", ("notebooks/05_mixed_precision.ipynb", "scripts/train/measure.py",
                                     "notebooks/09_from_notebook_to_cluster.ipynb")),
    "memory_snapshot": PrivateAPI(
        "torch.cuda.memory", "_snapshot", "helpers/measure/memory.py (cuda_step_snapshot)",
        "the recorded history as a dict; documented, but only under this name"),
    "dump_memory_snapshot": PrivateAPI(
        "torch.cuda.memory", "_dump_snapshot",
        "helpers/measure/memory.py (cuda_step_snapshot), notebook 05's worker memory_snapshot (the lesson), "
        "scripts/train/measure.py's --memory-snapshot (notebook 09's cells)",
        "writes the pickle that pytorch.org/memory_viz draws; documented, but only under this name",
        ("notebooks/05_mixed_precision.ipynb", "scripts/train/measure.py",
         "notebooks/09_from_notebook_to_cluster.ipynb")),
    "default_first_bucket_bytes": PrivateAPI(
        "torch.distributed", "_DEFAULT_FIRST_BUCKET_BYTES",
        "scripts/ddp_bench.py's bucket_plan (notebook 02's cell: DDP's bucket rule, the lesson)",
        "DDP's small first bucket (1 MiB) that its rebuilt buckets start with; no public constant or argument "
        "exposes it", ("notebooks/02_ddp.ipynb", "scripts/ddp_bench.py")),
    "dump_fr_trace": PrivateAPI(
        "torch._C._distributed_c10d", "_dump_fr_trace", "notebook 09b's worker recorded_collectives (the lesson)",
        "a rank's own flight-recorder record: torch dumps the records by itself only on an NCCL timeout, never on "
        "gloo, and no public function returns them", ("notebooks/09b_debugging_distributed_jobs.ipynb",)),
    "sdpa_flash_op": PrivateAPI(
        "torch.ops", "aten._scaled_dot_product_flash_attention", _RECIPE_AC, _SDPA_OPS,
        ("scripts/train/ac.py", "notebooks/05_mixed_precision.ipynb")),
    "sdpa_efficient_op": PrivateAPI(
        "torch.ops", "aten._scaled_dot_product_efficient_attention", _RECIPE_AC, _SDPA_OPS,
        ("scripts/train/ac.py", "notebooks/05_mixed_precision.ipynb")),
    "sdpa_math_op": PrivateAPI(
        "torch.ops", "aten._scaled_dot_product_attention_math", _RECIPE_AC, _SDPA_OPS,
        ("scripts/train/ac.py", "notebooks/05_mixed_precision.ipynb")),
    "lookup_backend": PrivateAPI(
        "torch._dynamo", "lookup_backend",
        "helpers/measure/tensor_parallel.py (GraphCounter, a counting backend around a named one)",
        "a custom backend that wraps a named one needs that backend's callable; torch.compile takes a name or a "
        "callable, and torch.compiler.list_backends gives names only"),
}


class PrivateAPIGone(ImportError):
    """A private torch API the helpers rely on is not in the installed torch."""


def resolve(name: str):
    """The private object registered as `name`, or PrivateAPIGone naming it, its users and why it is needed."""
    api = PRIVATE[name]
    try:
        found = importlib.import_module(api.module)
        for part in api.attribute.split("."):
            found = getattr(found, part)
        return found
    except (ImportError, AttributeError) as exc:
        import torch

        raise PrivateAPIGone(
            f"torch {torch.__version__} has no {api.module}.{api.attribute} ({type(exc).__name__}: {exc}). "
            f"Used by {api.used_by}, because {api.why}. Look for its new name or a public API that now does "
            f"the job, and change helpers/torch_private.py.") from exc


def missing() -> list[str]:
    """The registered names the installed torch lacks."""
    gone = []
    for name in PRIVATE:
        try:
            resolve(name)
        except PrivateAPIGone:
            gone.append(name)
    return gone


def __getattr__(name: str):
    """`from helpers.torch_private import TorchDispatchMode`: resolved on first use, so a module that needs only
    one entry still imports when another one is gone."""
    if name in PRIVATE:
        return resolve(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
