# From the PyTorch distributed cookbook: notebooks/00_launching_workers.ipynb, the cells tagged 'script:hello_distributed.py'.
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
# Run: torchrun --standalone --nproc-per-node=2 hello_distributed.py --help
"""The smallest complete torchrun program: every rank adds its number with all_reduce."""
import argparse
import os

import torch
import torch.distributed as dist


def first_all_reduce():
    """Rank r holds r + 1; after all_reduce (a sum) every rank holds n(n+1)/2."""
    local_rank = int(os.environ["LOCAL_RANK"])
    on_gpu = torch.cuda.is_available() and int(os.environ["LOCAL_WORLD_SIZE"]) <= torch.cuda.device_count()
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)  # the current device: object collectives and DCP put their tensors there
    dist.init_process_group("nccl" if on_gpu else "gloo", device_id=device if on_gpu else None)
    try:
        rank, world, backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
        value = torch.tensor([float(rank + 1)], device=device)
        dist.all_reduce(value)
        print(f"rank {rank}/{world} on {device} ({backend}): {value.item()}")
        return {"rank": rank, "world_size": world, "backend": backend, "device": str(device),
                "pid": os.getpid(), "parent_pid": os.getppid(), "sum": value.item()}
    finally:
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description="every rank adds its number with all_reduce")
    parser.parse_args()
    result = first_all_reduce()
    if result["rank"] == 0:
        n = result["world_size"]
        print(f"summary: {n} ranks on {result['backend']}, all_reduce sum {result['sum']:g} "
              f"(n(n+1)/2 = {n * (n + 1) / 2:g})")

if __name__ == "__main__":
    main()
