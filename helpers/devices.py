"""What this machine has, and which device and backend a rank should use.

Why a module of its own: asking the CUDA runtime how many GPUs there are initialises CUDA in the asking process
(seconds, and a context's memory on the GPU), and a process that has done so can no longer be forked safely. The
kernel is never forked (workers come from the launcher's fork-server, which never touches CUDA), but describing the
machine should cost nothing: every question about GPUs asked from the kernel goes through NVML here. Which ranks
get a GPU is decided in one place (`default_backend`, `placement`), from the number of GPUs it is handed.
The functions a worker calls (`rank_device`, `default_backend`) are optional sugar: the same worker code can
spell them out with plain PyTorch and still run under torchrun.
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys


def gpu_count() -> int:
    """Visible CUDA GPUs, counted without creating a CUDA context in this process.

    torch.cuda.device_count() asks NVML first ("will NOT poison fork if NVML discovery succeeds", its docstring
    says); where NVML cannot answer (PyPI's CUDA build on a machine without an NVIDIA driver) it asks the CUDA
    runtime, still without a context."""
    import torch

    if not torch.backends.cuda.is_built():
        return 0
    return torch.cuda.device_count()


def cuda_initialized() -> bool:
    """True once this process holds a CUDA context: from then on fork is unsafe."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def gpu_names() -> list[str]:
    """GPU model names from nvidia-smi (no CUDA context); empty where there is none."""
    if not shutil.which("nvidia-smi") or gpu_count() == 0:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def usable_cores() -> int:
    """Cores this process may run on (the affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def default_backend(world_size: int | None = None, gpus: int | None = None) -> str:
    """'nccl' when every local rank can have a GPU of its own, else 'gloo'.

    In a worker started by `helpers.launch` the launcher's choice (COOKBOOK_BACKEND) wins, so that a one-GPU
    machine running two ranks uses gloo for both rather than two NCCL ranks on one GPU (which NCCL refuses).
    gpus: the GPUs to decide for (default: this machine's), so that a CPU test can drive the GPU decision.
    """
    chosen = os.environ.get("COOKBOOK_BACKEND")
    if chosen:
        return chosen
    import torch.distributed as dist

    local = world_size or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = gpu_count() if gpus is None else gpus
    if dist.is_nccl_available() and gpus >= 1 and local <= gpus:
        return "nccl"
    return "gloo"


# What a CPU rank on a GPU machine gets: the GPUs hidden, and gloo named, see `cpu_ranks_env`.
CPU_ONLY_ENV = {"CUDA_VISIBLE_DEVICES": "", "COOKBOOK_BACKEND": "gloo"}


def cpu_ranks_env(world_size: int, gpus: int) -> dict[str, str]:
    """The environment for a demo's ranks: `CPU_ONLY_ENV` when they run on CPU although the machine has GPUs.

    Why hide the GPUs: with more ranks than GPUs the ranks compute on CPU with gloo, but a process that can see a
    GPU makes torch's own code take "CUDA is available" to mean "these tensors are on CUDA": PowerSGD's hook calls
    `torch.cuda.synchronize(bucket.device)` whenever `torch.cuda.is_available()`, which raises for a CPU bucket
    (tests/measure/test_ddp_measure.py reproduces it); DCP's writer creates a CUDA stream, and with it a CUDA context on
    GPU 0, in every CPU rank that saves. A CPU rank that cannot see a GPU is a CPU rank all the way down.
    Why COOKBOOK_BACKEND too: `launch` picks the workers' backend from the kernel's view of the machine, so a
    world-size-1 launch on a one-GPU machine says "nccl" even where the env hides the GPU, and a helper worker's
    `rank_device()` would then pick a cuda:0 that the rank cannot see. Ranks that each have a GPU keep them.
    """
    return dict(CPU_ONLY_ENV) if 0 < gpus < world_size else {}


def placement(world_size: int, gpus: int) -> dict:
    """Where `world_size` ranks on this node run when it has `gpus` GPUs, and the line a notebook prints about it.

    NCCL gives each rank a GPU of its own and refuses two ranks on one GPU, so the ranks get GPUs only when there
    are enough for all; otherwise every rank runs on the CPU with gloo, with the GPUs hidden from it
    (`cpu_ranks_env`).
    Returns {"on_gpus": bool, "backend": "nccl" or "gloo", "env": for `launch(env=...)`, "text": the line}.
    """
    on_gpus = 1 <= world_size <= gpus
    if on_gpus:
        text = f"{world_size} rank(s), NCCL, one GPU each"
    elif gpus:
        text = (f"{world_size} ranks, gloo on the CPU: this machine has {gpus} GPU(s) and NCCL needs one per rank "
                "(the GPUs are hidden from these ranks)")
    else:
        text = f"{world_size} ranks, gloo on the CPU (no GPU here)"
    return {"on_gpus": on_gpus, "backend": "nccl" if on_gpus else "gloo",
            "env": cpu_ranks_env(world_size, gpus), "text": text}


def rank_device():
    """The torch.device this rank should compute on: its own GPU under NCCL, else the CPU.

    Correct on a CPU-only build, where `torch.accelerator.current_accelerator()` returns None.
    """
    import torch

    if default_backend() == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def machine_facts() -> dict:
    """The context every measured figure needs: torch, device, backends, CPU capability, cores."""
    import torch
    import torch.distributed as dist

    gpus = gpu_count()
    accel = None
    if hasattr(torch, "accelerator") and gpus == 0:
        # Safe without GPUs: no CUDA context can be created. With GPUs we avoid it (it may initialise CUDA).
        accel = torch.accelerator.current_accelerator(check_available=True)  # CUDA build, no GPU: None
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda_build": torch.version.cuda,
        "gpus": gpus,
        "gpu_names": gpu_names(),
        "accelerator": str(accel) if accel is not None else ("cuda" if gpus else None),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": usable_cores(),
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "mpi": dist.is_mpi_available(),
        # for the launcher's default world size: a rank per GPU with two or more GPUs, else two CPU ranks
        "default_backend": default_backend(world_size=gpus if gpus >= 2 else 2, gpus=gpus),
    }


def describe_machine() -> dict:
    """Print `machine_facts()` as a short table and return it (the first cell of every notebook)."""
    facts = machine_facts()
    width = max(len(k) for k in facts)
    for key, value in facts.items():
        print(f"{key:<{width}}  {value}")
    return facts


def synchronize(device=None) -> None:
    """Wait for the work queued on `device` (a no-op for the CPU or None), so a wall-clock interval measures the
    work and not its launch. For workers: on a GPU it uses that process's accelerator context."""
    if device is None:
        return
    import torch

    device = torch.device(device)
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
