# From the PyTorch distributed cookbook: the cells tagged 'script:train/distributed.py' in
#   notebooks/02_ddp.ipynb
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
"""Joining and leaving the process group that torchrun's environment describes: one rank's life, in two functions
every script, notebook and the recipe share.

    device = init_distributed()         # RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT from torchrun
    run_distributed(train, args)        # init, train(device, args), free everything, destroy the group
"""
import atexit
import gc
import os

import torch
import torch.distributed as dist

# The group this process joined last, referenced until it joins the next one or ends, also after
# destroy_process_group(). A comm hook's future callbacks (PowerSGD's, the fp16 hook's) hold the group and are freed
# on gloo's own worker thread, some time after the step that used them. If theirs were the last reference, the group
# would be destroyed on that thread, which then joins itself: "terminate called after throwing an instance of
# 'std::system_error' / Resource deadlock avoided", SIGABRT at the end of a finished run (notebook 02b's PowerSGD run
# hit it on a busy machine; tests/launcher/test_process_group_lifetime.py makes it happen every time). Held here, the group
# is freed by this thread, its callbacks long done: at the next init_distributed, or by the atexit hook while the
# interpreter is still whole (a group left for the interpreter's own teardown can abort there too).
GROUPS_JOINED: list = []
atexit.register(GROUPS_JOINED.clear)


def uses_gpu() -> bool:
    """One GPU per local rank, or the CPU for every rank (never a mix). More local ranks than visible GPUs is a
    mistake, not a reason to fall back to the CPU silently: ValueError, one line. The count decides, not
    is_available(), which a process answers once: CUDA_VISIBLE_DEVICES= set after that first answer hides them."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        return False
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local_world > gpus:

        raise ValueError(f"{local_world} ranks on this node but {gpus} visible GPU{'s' * (gpus != 1)}: one GPU per rank "
                         "(or hide them with CUDA_VISIBLE_DEVICES= to train on the CPU)")
    return True


def init_distributed() -> torch.device:
    """Join the process group; returns this rank's device. On GPUs: NCCL for CUDA tensors, bound to this rank's GPU
    (set_device first: object collectives and DCP use the current device; then device_id), and gloo beside it for
    CPU tensors (a CPU-offloaded gradient norm, a CPU flag, async checkpoint saves). On CPUs: gloo."""
    if uses_gpu():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    GROUPS_JOINED[:] = [dist.group.WORLD]
    return device


def run_distributed(body, *args, **kwargs):
    """One rank's whole life: join, run body(device, ...), free what it built, leave (also after an error).

    `body` returns plain values (numbers, lists, CPU tensors), so DDP's reducer, FSDP's state and the optimizer die
    with its frame; gc.collect() reaps what cycles keep, before destroy_process_group(). Skipping this made a gloo
    job abort at exit now and then ("terminate called without an active exception")."""
    device = init_distributed()
    try:
        return body(device, *args, **kwargs)
    finally:
        gc.collect()
        dist.destroy_process_group()
