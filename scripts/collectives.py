# From the PyTorch distributed cookbook: notebooks/01_process_groups_and_collectives.ipynb, the cells tagged 'script:collectives.py'.
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
# Run: torchrun --standalone --nproc-per-node=2 collectives.py --help
"""Collectives by hand and by torch.distributed: a ring all-reduce built from point-to-point messages, checked
against dist.all_reduce, and a tour of every collective, checked against its closed form.

    torchrun --standalone --nproc-per-node=2 collectives.py --elements-per-rank 1000
"""
import argparse
import gc
import os
import time

import torch
import torch.distributed as dist

# torch 2.13 adds all_gather_single/reduce_scatter_single and deprecates all_gather_into_tensor/
# reduce_scatter_tensor (same arguments); older releases (2.11) have only the older names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def start_process_group(**init_args):
    """Join the group (env:// unless `init_args` say otherwise) on this rank's own GPU with NCCL when every local
    rank can have one, else on the CPU with gloo. Returns the device this rank computes on."""
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.is_available() and local_world <= torch.cuda.device_count():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # batch_isend_irecv under NCCL wants the current device set
        dist.init_process_group(backend="nccl", device_id=device, **init_args)
    else:
        device = torch.device("cpu")
        dist.init_process_group(backend="gloo", **init_args)
    return device


def exchange(traffic, sends=(), recvs=()):
    """Post every (tensor, peer) send and receive at once, wait for them all, and count this rank's bytes."""
    ops = [dist.P2POp(dist.isend, t, peer) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in recvs]
    for handle in dist.batch_isend_irecv(ops) if ops else []:  # it refuses an empty list (one rank, alone)
        handle.wait()
    traffic["sent"] += sum(t.numel() * t.element_size() for t, _ in sends)
    traffic["received"] += sum(t.numel() * t.element_size() for t, _ in recvs)


def ring_all_reduce(tensor):
    """Sum `tensor` over all ranks, in place, by a ring of point-to-point messages. Returns the bytes moved."""
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = list(tensor.view(-1).tensor_split(n))  # views into `tensor`; sizes differ by at most one element
    traffic = {"sent": 0, "received": 0}
    for step in range(n - 1):  # reduce-scatter: add what arrives
        send_i, recv_i = (rank - step) % n, (rank - step - 1) % n
        incoming = torch.empty_like(chunks[recv_i])
        exchange(traffic, sends=[(chunks[send_i], right)], recvs=[(incoming, left)])
        chunks[recv_i] += incoming
    for step in range(n - 1):  # all-gather: overwrite with the finished chunk
        send_i, recv_i = (rank + 1 - step) % n, (rank - step) % n
        exchange(traffic, sends=[(chunks[send_i], right)], recvs=[(chunks[recv_i], left)])
    return traffic


def root_all_reduce(tensor):
    """Sum `tensor` over all ranks through rank 0 (a parameter server on rank 0). Returns the bytes moved."""
    rank, n = dist.get_rank(), dist.get_world_size()
    traffic = {"sent": 0, "received": 0}
    if rank == 0:
        incoming = [torch.empty_like(tensor) for _ in range(1, n)]
        exchange(traffic, recvs=[(t, src) for src, t in enumerate(incoming, start=1)])
        tensor += sum(incoming)
        exchange(traffic, sends=[(tensor, dst) for dst in range(1, n)])
    else:
        exchange(traffic, sends=[(tensor, 0)])
        exchange(traffic, recvs=[(tensor, 0)])
    return traffic


def bytes_written():
    """Bytes this process has handed to write()/writev() so far, as Linux counts them (/proc/self/io): that is how
    gloo's TCP transport sends, so around a gloo exchange it is the bytes put on the wire. None elsewhere."""
    try:
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("wchar:")).split()[1])
    except (OSError, StopIteration):
        return None


def ring_check(elements_per_rank, device):
    """One all-reduce three ways (the ring, through rank 0, dist.all_reduce), for a length divisible by n and one
    that is not. Integers: every summation order gives the same answer, so "equal" can mean torch.equal."""
    rank, n = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(1000 + rank)
    out = {}
    for label, numel in (("divisible", n * elements_per_rank), ("uneven", n * elements_per_rank + 1)):
        x = torch.randint(-1000, 1000, (numel,), generator=generator, dtype=torch.int64).to(device)
        by_ring, by_root, by_torch = x.clone(), x.clone(), x.clone()
        traffic = {}
        for way, all_reduce_by, tensor in (("ring", ring_all_reduce, by_ring), ("root", root_all_reduce, by_root)):
            dist.barrier()
            before = bytes_written()
            traffic[way] = all_reduce_by(tensor)
            after = bytes_written()  # the kernel's count, beside the code's own: None unless gloo on Linux
            on_tcp = before is not None and dist.get_backend() == "gloo"
            traffic[way]["on_the_wire"] = after - before if on_tcp else None
        dist.all_reduce(by_torch)
        out[label] = {"input": x.cpu(), "ring": by_ring.cpu(), "root": by_root.cpu(), "torch": by_torch.cpu(),
                      "traffic": traffic, "size_bytes": x.numel() * x.element_size()}
    return out


def ring_worker(elements_per_rank):
    device = start_process_group()
    try:
        return ring_check(elements_per_rank, device)
    finally:
        gc.collect()
        dist.destroy_process_group()


def collectives_tour(device):
    """Every collective once. Returns {operation: (this rank's tensor before, after)} on the CPU; None where the
    operation leaves this rank's buffer undefined or gives it nothing."""
    rank, n = dist.get_rank(), dist.get_world_size()

    def start():
        return (10 * (rank + 1) + torch.arange(n, dtype=torch.float32)).to(device)

    def empty(k):
        return torch.empty(k, device=device)

    seen = {}
    x = start()
    dist.broadcast(x, src=0)
    seen["broadcast(src=0)"] = (start(), x)
    x = start()
    dist.reduce(x, dst=0)                              # SUM into rank 0; other ranks' buffers are undefined
    seen["reduce(dst=0)"] = (start(), x if rank == 0 else None)
    for name in ("SUM", "AVG", "MAX"):
        x = start()
        dist.all_reduce(x, op=getattr(dist.ReduceOp, name))
        seen[f"all_reduce({name})"] = (start(), x)
    parts = [empty(n) for _ in range(n)]
    dist.all_gather(parts, start())                    # a list of n tensors
    seen["all_gather"] = (start(), torch.cat(parts))
    out = empty(n * n)
    all_gather_single(out, start())                    # one tensor, n times as long
    seen["all_gather_single"] = (start(), out)
    out = empty(1)
    reduce_scatter_single(out, start())                # rank r gets element r of the sum
    seen["reduce_scatter_single"] = (start(), out)
    out = empty(n)
    dist.all_to_all_single(out, start())               # rank r gets element r of every rank
    seen["all_to_all_single"] = (start(), out)
    outs = [empty(1) for _ in range(n)]
    try:
        dist.all_to_all(outs, list(start().chunk(n)))  # the same with lists of tensors
        seen["all_to_all"] = (start(), torch.cat(outs))
    except RuntimeError as error:                      # gloo in older torch (2.11) has only all_to_all_single
        if "does not support alltoall" not in str(error):
            raise
    out = empty(1)
    dist.scatter(out, list(start().chunk(n)) if rank == 0 else None, src=0)
    seen["scatter(src=0)"] = (start() if rank == 0 else None, out)
    gathered = [empty(n) for _ in range(n)] if rank == 0 else None
    dist.gather(start(), gathered, dst=0)
    seen["gather(dst=0)"] = (start(), torch.cat(gathered) if rank == 0 else None)
    x = start()
    work = dist.all_reduce(x, async_op=True)           # returns a Work handle at once
    independent = torch.randn(64, 64, device=device) @ torch.randn(64, 64, device=device)  # overlaps with it
    work.wait()
    seen["all_reduce(async_op=True)"] = (start(), x)
    return {op: tuple(None if t is None else t.cpu() for t in pair) for op, pair in seen.items()}


def closed_forms(n):
    """What rank r holds after each operation of `collectives_tour` on n ranks: {operation: [one per rank]}."""
    x = [10 * (r + 1) + torch.arange(n, dtype=torch.float32) for r in range(n)]  # what rank r started with
    total = torch.stack(x).sum(0)
    column = [torch.stack([x[q][r] for q in range(n)]) for r in range(n)]        # element r of every rank
    everywhere = lambda t: [t] * n  # noqa: E731
    return {"broadcast(src=0)": everywhere(x[0]), "reduce(dst=0)": [total] + [None] * (n - 1),
            "all_reduce(SUM)": everywhere(total), "all_reduce(AVG)": everywhere(total / n),
            "all_reduce(MAX)": everywhere(torch.stack(x).amax(0)), "all_gather": everywhere(torch.cat(x)),
            "all_gather_single": everywhere(torch.cat(x)), "reduce_scatter_single": [total[r:r + 1] for r in range(n)],
            "all_to_all_single": column, "all_to_all": column, "scatter(src=0)": [x[0][r:r + 1] for r in range(n)],
            "gather(dst=0)": [torch.cat(x)] + [None] * (n - 1), "all_reduce(async_op=True)": everywhere(total)}


def tour_mismatches(seen, rank, n):
    """The operations whose result on `rank` differs from its closed form (AVG divides: equal up to rounding)."""
    expected = closed_forms(n)
    if "all_to_all" not in seen:                       # not run: this torch's gloo lacks the list form
        del expected["all_to_all"]
    wrong = sorted(set(seen) ^ set(expected))
    for op, per_rank in expected.items():
        want, got = per_rank[rank], seen.get(op, (None, None))[1]
        if (want is None) != (got is None) or (want is not None and not torch.allclose(got, want, rtol=1e-6, atol=0)):
            wrong.append(op)
    return wrong


def detail_cost(rounds=15, calls=20):
    """Seconds per call of a one-number all-reduce (gloo) on the default group, checked when the process started
    with TORCH_DISTRIBUTED_DEBUG=DETAIL, and on a group created with the check off: per round, side by side."""
    dist.init_process_group(backend="gloo")
    try:
        dist.set_debug_level(dist.DebugLevel.OFF)
        unchecked = dist.new_group()  # created while the check is off: not wrapped
        dist.set_debug_level_from_env()
        tensor = torch.ones(1)

        def per_call_s(group):
            start = time.perf_counter()
            for _ in range(calls):
                dist.all_reduce(tensor, group=group)
            return (time.perf_counter() - start) / calls

        per_call_s(None), per_call_s(unchecked)  # warm-up
        rounds_s = [(per_call_s(None), per_call_s(unchecked)) for _ in range(rounds)]
        return {"debug_level": str(dist.get_debug_level()), "detail_s": [d for d, _ in rounds_s],
                "off_s": [o for _, o in rounds_s]}
    finally:
        gc.collect()
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements-per-rank", type=int, default=250_000,
                        help="int64 elements per rank in the ring's tensor (times the world size)")
    args = parser.parse_args()
    device = start_process_group()
    try:
        rank, n = dist.get_rank(), dist.get_world_size()
        ring = ring_check(args.elements_per_rank, device)
        wrong = [label for label, case in ring.items() if not torch.equal(case["ring"], case["torch"])]
        sent, size = ring["divisible"]["traffic"]["ring"]["sent"], ring["divisible"]["size_bytes"]
        assert not wrong and sent * n == 2 * (n - 1) * size, f"rank {rank}: ring {wrong} wrong, or sent {sent} B"
        seen = collectives_tour(device)
        wrong = tour_mismatches(seen, rank, n)
        assert not wrong, f"rank {rank}: {wrong} differ from their closed forms"
        dist.barrier()  # every rank has passed its checks
        if rank == 0:
            print(f"summary: {n} ranks, {dist.get_backend()} on {device.type}: the ring all-reduce equals "
                  f"dist.all_reduce, each rank sent 2(n-1)/n = {sent / size:.4f} of {size} bytes; "
                  f"{len(seen)} collectives equal their closed forms", flush=True)
    finally:
        gc.collect()
        dist.destroy_process_group()

if __name__ == "__main__":
    main()
