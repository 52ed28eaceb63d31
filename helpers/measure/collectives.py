"""Timing collectives done right: warm-ups, a barrier before every timed call, the slowest rank, medians and spread,
algbw and busbw as nccl-tests defines them, read against the ceilings `helpers.measure.ceilings` measures.

Why a module: every notebook that says "communication costs X" needs the same discipline, and the mistakes are
easy to make (timing the first call, which includes connection set-up; timing one rank, which may have arrived
late; forgetting `cuda.synchronize`, which times the kernel launch; comparing a reduce-scatter's bandwidth with
an all-reduce's without the bus factor). `time_collective` and `ceilings.measure_ceilings` are called inside a
worker after `dist.init_process_group()`: notebook 10's worker receives them as arguments. Notebook 01b times
collectives in its own cells (the discipline is its lesson) and is handed only the plumbing around the timed call,
`SWEEP_PLUMBING`. From the kernel the pure arithmetic, reading and formatting are called; no function here launches
workers.

Definitions (nccl-tests, doc/PERFORMANCE.md). S is the size of the *full* array in bytes: the all-reduce buffer,
the all-gather output, the reduce-scatter input, the all-to-all buffer of one rank, the broadcast buffer.
    algbw = S / t
    busbw = algbw * factor(collective, n)
    factor: all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n; broadcast, reduce 1.
busbw is what each rank's link must carry per second for the best (ring/bandwidth-optimal) algorithm, so it is the
number to hold against a link's bandwidth, and it does not change with n for a bandwidth-bound collective.
"""
from __future__ import annotations

import os
import socket
import time
import zlib
from types import SimpleNamespace

from helpers.devices import synchronize, usable_cores
from helpers.measure.ceilings import GB, best_ceilings, format_ceilings, human_bytes, measure_ceilings
from helpers.measure.timing import summarize

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce")
# Called in place here (one buffer is input and output); the others write a separate output buffer. On one rank NCCL
# does nothing for an in-place call and one device copy of S for an out-of-place one (see `one_rank_rows`).
IN_PLACE = ("all_reduce", "broadcast", "reduce")
_ALIASES = {"all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
            "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
            "all_to_all_single": "all_to_all", "allreduce": "all_reduce", "allgather": "all_gather",
            "reducescatter": "reduce_scatter", "alltoall": "all_to_all"}


def canonical(name: str) -> str:
    """The collective's name in this module ('all_gather_single' -> 'all_gather')."""
    key = name.lower()
    key = _ALIASES.get(key, key)
    if key not in COLLECTIVES:
        raise ValueError(f"unknown collective {name!r}; known: {', '.join(COLLECTIVES)}")
    return key


def busbw_factor(name: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor for collective `name` on `n` ranks (S is the full array)."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    key = canonical(name)
    if key == "all_reduce":
        return 2 * (n - 1) / n
    if key in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def algbw(size_bytes: float, seconds: float) -> float:
    """Algorithm bandwidth S/t in bytes per second."""
    return size_bytes / seconds


def busbw(name: str, n: int, size_bytes: float, seconds: float) -> float:
    """Bus bandwidth algbw * factor in bytes per second."""
    return algbw(size_bytes, seconds) * busbw_factor(name, n)


def size_sweep(min_bytes: int, max_bytes: int, factor: int = 4) -> list[int]:
    """Message sizes min_bytes, min_bytes*factor, ... up to max_bytes (included when on the grid)."""
    if min_bytes < 1 or max_bytes < min_bytes or factor < 2:
        raise ValueError(f"need 1 <= min_bytes <= max_bytes and factor >= 2, got {min_bytes}, {max_bytes}, {factor}")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def oversubscription_warning(world_size: int, cores: int | None = None) -> str | None:
    """A warning to print when more ranks than cores run on this host, else None."""
    cores = usable_cores() if cores is None else cores
    if world_size > cores:
        return (f"WARNING: {world_size} ranks share {cores} CPU cores: ranks take turns on the cores, so these "
                f"times measure the operating system's scheduler as much as the collective. Read them for "
                f"correctness, not throughput.")
    return None


# ----------------------------------------------------------------------------------------------- in a worker

def _barrier(group, device) -> None:
    """Every rank leaves together (as far as a barrier can promise), with the device idle."""
    import torch.distributed as dist

    synchronize(device)
    if device.type == "cuda" and str(dist.get_backend(group)) == "nccl":  # NCCL's barrier is an all-reduce on a GPU
        dist.barrier(group=group, device_ids=[device.index])
    else:
        dist.barrier(group=group)
    synchronize(device)


def _buffers(name: str, size_bytes: int, n: int, device, dtype):
    """Input and output of one collective whose full array is about `size_bytes` (whole elements, divisible by n)."""
    import torch

    elem = torch.tensor([], dtype=dtype).element_size()
    count = max(n, (size_bytes // elem) // n * n)
    if name == "all_gather":
        return torch.zeros(count // n, dtype=dtype, device=device), torch.zeros(count, dtype=dtype, device=device)
    if name == "reduce_scatter":
        return torch.zeros(count, dtype=dtype, device=device), torch.zeros(count // n, dtype=dtype, device=device)
    if name in IN_PLACE:
        buf = torch.zeros(count, dtype=dtype, device=device)
        return buf, buf
    return torch.zeros(count, dtype=dtype, device=device), torch.zeros(count, dtype=dtype, device=device)


def single_tensor_collectives():
    """(all_gather_single, reduce_scatter_single) of this torch: the 2.13 names, else the older ones.

    Why: torch 2.13 adds `all_gather_single`/`reduce_scatter_single` and deprecates `all_gather_into_tensor`/
    `reduce_scatter_tensor` (same arguments); torch 2.11 has only the older names. Looked up at call time, so a
    test can take the new names away.
    """
    import torch.distributed as dist

    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor,
            getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)


def _operation(name: str, inp, out, group):
    """A zero-argument callable that runs the collective once (synchronous API)."""
    import torch.distributed as dist

    all_gather_single, reduce_scatter_single = single_tensor_collectives()
    if name == "all_reduce":
        return lambda: dist.all_reduce(inp, group=group)
    if name == "all_gather":
        return lambda: all_gather_single(out, inp, group=group)
    if name == "reduce_scatter":
        return lambda: reduce_scatter_single(out, inp, group=group)
    if name == "all_to_all":
        return lambda: dist.all_to_all_single(out, inp, group=group)
    if name == "broadcast":
        return lambda: dist.broadcast(inp, group=group, group_src=0)
    if name == "reduce":
        return lambda: dist.reduce(inp, group=group, group_dst=0)
    raise ValueError(name)


def _check_result(name: str, inp, out, group, device) -> None:
    """Run the collective once more on known inputs and compare with its closed form (small integers: exact)."""
    import torch
    import torch.distributed as dist

    r, n = dist.get_rank(group), dist.get_world_size(group)
    chunk = inp.numel() // n if name in ("reduce_scatter", "all_to_all") else inp.numel()
    chunk_of = torch.arange(inp.numel(), device=device) // max(1, chunk)  # which rank's chunk each element is
    if name in ("reduce_scatter", "all_to_all"):
        inp.copy_(r * n + chunk_of)  # rank r, chunk j holds r*n + j
    else:
        inp.fill_(r + 1)
    out_zero = out is not inp
    if out_zero:
        out.zero_()
    _operation(name, inp, out, group)()
    synchronize(device)
    triangle = n * (n + 1) // 2
    if name == "all_reduce":
        expected = torch.full_like(inp, triangle)
        got = inp
    elif name == "all_gather":
        expected = (torch.arange(out.numel(), device=device) // inp.numel() + 1).to(out.dtype)
        got = out
    elif name == "reduce_scatter":  # sum over ranks q of q*n + r
        expected = torch.full_like(out, n * (n - 1) // 2 * n + n * r)
        got = out
    elif name == "all_to_all":  # chunk j comes from rank j, which held j*n + r there
        expected = (torch.arange(out.numel(), device=device) // chunk * n + r).to(out.dtype)
        got = out
    elif name == "broadcast":
        expected, got = torch.full_like(inp, 1), inp
    else:  # reduce: defined on the destination only
        if r != 0:
            return
        expected, got = torch.full_like(inp, triangle), inp
    if not torch.equal(got, expected):
        wrong = (got != expected).sum().item()
        raise AssertionError(f"{name} on {n} ranks: {wrong} of {got.numel()} elements differ from the closed form "
                             f"on rank {r}")


def host_clock() -> float:
    """Seconds on a clock every process on this host shares (CLOCK_MONOTONIC), so ranks' times can be compared."""
    if hasattr(time, "CLOCK_MONOTONIC"):
        return time.clock_gettime(time.CLOCK_MONOTONIC)
    return time.time()


def _per_call_times(starts, ends, group, device) -> tuple[list[float], str]:
    """One time per repeat, agreed by every rank (one all-reduce, after the timed loop).

    All ranks on one host: from the first rank's start to the last rank's end, on the shared clock. This counts
    the barrier's exit skew against the collective rather than hiding it, and it stops a receiver that starts its
    clock late (its data already waiting in socket buffers) from looking faster than the link. Ranks on several
    hosts, whose clocks differ: the slowest rank's own duration.
    """
    import torch
    import torch.distributed as dist

    host = float(zlib.crc32(socket.gethostname().encode()))
    durations = [e - s for s, e in zip(starts, ends)]
    packed = torch.tensor([-s for s in starts] + list(ends) + durations + [host, -host], dtype=torch.float64,
                          device=device)
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    values = packed.cpu().tolist()
    k = len(starts)
    first_start, last_end, slowest = [-v for v in values[:k]], values[k:2 * k], values[2 * k:3 * k]
    if values[-2] == -values[-1]:  # every rank reported the same host
        return [e - s for s, e in zip(first_start, last_end)], "first start to last end (one host)"
    return slowest, "slowest rank's own duration (several hosts)"


def time_collective(name: str, sizes: list[int], *, warmup: int = 5, repeats: int = 20, group=None, device=None,
                    dtype=None, check: bool = True) -> list[dict]:
    """Time collective `name` at every size; one record per size, the same on every rank of `group`.

    Per size: allocate the buffers once, run `warmup` untimed calls (connection set-up, allocator, caches), then
    `repeats` timed calls, each after a barrier, each timed from the call to the moment the device is idle again.
    A collective is done when its last rank is done, so a call's time is the slowest rank's: on one host, from
    the first rank's start to the last rank's end (see `_per_call_times`). The record carries every repeat, the
    median and the spread. `check`: afterwards run once on known inputs and compare with the closed form
    (raises AssertionError).
    """
    import torch
    import torch.distributed as dist

    from helpers.devices import rank_device

    key = canonical(name)
    device = rank_device() if device is None else torch.device(device)
    dtype = torch.float32 if dtype is None else dtype
    n = dist.get_world_size(group)
    backend = str(dist.get_backend(group))
    records = []
    for size in sizes:
        inp, out = _buffers(key, size, n, device, dtype)
        op = _operation(key, inp, out, group)
        for _ in range(warmup):
            op()
        synchronize(device)
        starts, ends = [], []
        for _ in range(repeats):
            _barrier(group, device)
            starts.append(host_clock())
            op()
            synchronize(device)
            ends.append(host_clock())
        times, timing = _per_call_times(starts, ends, group, device)
        if check:
            _check_result(key, inp, out, group, device)
        records.append(collective_record(key, backend, device, n, inp, out, times, timing, checked=check))
        del inp, out, op
    return records


def collective_record(name: str, backend: str, device, n: int, inp, out, times: list[float], timing: str,
                      checked: bool = True) -> dict:
    """One size's record, from the per-call times every rank agreed on: the repeats, median and spread, algbw and
    busbw (nccl-tests' definitions, S the full array), the cores, and how the times were taken."""
    key = canonical(name)
    full = (out if key == "all_gather" else inp).numel() * inp.element_size()
    stats, factor, cores = summarize(times), busbw_factor(key, n), usable_cores()
    return {
        "collective": key, "backend": backend, "device": device.type, "world_size": n, "size_bytes": full,
        "dtype": str(inp.dtype).replace("torch.", ""), "factor": factor, "times_s": times, **stats,
        "algbw": algbw(full, stats["median_s"]), "busbw": algbw(full, stats["median_s"]) * factor,
        # the spread of busbw follows the time quartiles (fast time = high bandwidth)
        "busbw_q1": algbw(full, stats["q3_s"]) * factor, "busbw_q3": algbw(full, stats["q1_s"]) * factor,
        "cores": cores, "oversubscribed": n > cores, "checked": checked, "timing": timing,
    }


# What notebook 01b's own `time_collective` (a cell: the nccl-tests timing discipline is its lesson) is handed: the
# plumbing around the timed call. Each is a plain function of this module, called inside the worker.
SWEEP_PLUMBING = SimpleNamespace(buffers=_buffers, operation=_operation, barrier=_barrier, clock=host_clock,
                                 agreed_times=_per_call_times, check=_check_result, record=collective_record)


# ------------------------------------------------------------------------------------------------- reading

def format_table(records: list[dict], ceiling: dict | None = None) -> str:
    """nccl-tests-like text table: size, median time and spread, algbw, busbw, busbw as % of `ceiling`."""
    lines = []
    warnings = {oversubscription_warning(r["world_size"], r["cores"]) for r in records if r["oversubscribed"]}
    lines += sorted(w for w in warnings if w)
    head = (f"{'collective':<15}{'backend':<8}{'n':>3}{'size':>11}{'median us':>12}{'IQR us':>19}"
            f"{'algbw GB/s':>12}{'busbw GB/s':>12}")
    if ceiling:
        head += f"{'% of ' + ceiling['name']:>26}"
    lines.append(head)
    for r in records:
        row = (f"{r['collective']:<15}{r['backend']:<8}{r['world_size']:>3}{human_bytes(r['size_bytes']):>11}"
               f"{r['median_s'] * 1e6:>12.1f}{r['q1_s'] * 1e6:>9.1f}-{r['q3_s'] * 1e6:<9.1f}"
               f"{r['algbw'] / GB:>12.3f}{r['busbw'] / GB:>12.3f}")
        if ceiling:
            row += f"{100 * r['busbw'] / ceiling['rate']:>25.1f}%"
        lines.append(row)
    return "\n".join(lines)


def share_of_peak(rows: list[dict]) -> tuple[float, tuple[float, float]]:
    """The smallest message's busbw as a % of the best busbw among `rows`: (median, (slowest repeat, fastest))."""
    small, best = smallest(rows), peak(rows)
    low, mid, high = (100 * small["size_bytes"] * small["factor"] / t / best["busbw"]
                      for t in (small["max_s"], small["median_s"], small["min_s"]))
    return mid, (low, high)


def ratio_to_ceiling(record: dict, ceiling: dict) -> tuple[float, tuple[float, float]]:
    """A record's busbw over a bandwidth ceiling's rate: (medians' ratio, (slowest over fastest, fastest over
    slowest)), the interval spanning both measurements' repeats."""
    size = record["size_bytes"] * record["factor"]
    return ((size / record["median_s"]) / (ceiling["size_bytes"] / ceiling["median_s"]),
            ((size / record["max_s"]) / (ceiling["size_bytes"] / ceiling["min_s"]),
             (size / record["min_s"]) / (ceiling["size_bytes"] / ceiling["max_s"])))


def _iqr_rate(record: dict, factor: float = 1.0) -> tuple[float, float]:
    """The (low, high) rate S·factor/t of a record's time quartiles (a slow time is a low rate)."""
    return record["size_bytes"] * factor / record["q3_s"], record["size_bytes"] * factor / record["q1_s"]


def one_rank_rows(records: list[dict], copy: dict) -> list[dict]:
    """NCCL on one rank, per collective: what it does there, its fixed cost, and its copy against the device's.

    Why not busbw: on one rank nothing crosses a link, so busbw is 0 (all-reduce, all-gather, reduce-scatter,
    all-to-all: factor 0) or the algbw of a call that moves nothing (broadcast, reduce: factor 1). NCCL short-cuts a
    one-rank call (`ncclLaunchOneRank`, src/enqueue.cc): in place (`IN_PLACE`, as called here) it does nothing, so
    its time is the call's fixed cost at every size; out of place it is one device-to-device copy of S, so its algbw
    S/t is a copy rate, counted like `copy` (the device copy ceiling, S/t), and their ratio says how near NCCL's
    own copy comes to the GPU's. The ratio's spread spans both measurements' slowest and fastest repeats.
    Returns one dict per collective timed at world size 1: 'collective', 'in_place', 'does', 'small' and 'large'
    (the smallest and largest size's records) and, out of place, 'algbw', 'algbw_iqr', 'of_copy', 'of_copy_spread'.
    """
    rows = []
    for name in COLLECTIVES:
        mine = sorted((r for r in records if r["collective"] == name and r["world_size"] == 1),
                      key=lambda r: r["size_bytes"])
        if not mine:
            continue
        in_place = name in IN_PLACE
        row = {"collective": name, "in_place": in_place, "small": mine[0], "large": mine[-1],
               "does": "nothing (in place)" if in_place else "one device copy of S"}
        if not in_place:
            large = mine[-1]
            ratio, spread = ratio_to_ceiling({**large, "factor": 1.0}, copy)
            row.update(algbw=algbw(large["size_bytes"], large["median_s"]), algbw_iqr=_iqr_rate(large),
                       of_copy=ratio, of_copy_spread=spread)
        rows.append(row)
    return rows


def one_rank_table(rows: list[dict], copy: dict) -> str:
    """`one_rank_rows` as text: per collective, what NCCL does on one rank, the smallest and largest message's
    median time (IQR), and out of place the largest's algbw (IQR) over the device copy rate (spread)."""
    def cells(row):
        times = [f"{r['median_s'] * 1e6:.1f} ({r['q1_s'] * 1e6:.1f}-{r['q3_s'] * 1e6:.1f})"
                 for r in (row["small"], row["large"])]
        if row["in_place"]:
            return [row["collective"], row["does"], *times, "-", "-"]
        (low, high), (r_low, r_high) = row["algbw_iqr"], row["of_copy_spread"]
        return [row["collective"], row["does"], *times, f"{row['algbw'] / GB:.1f} ({low / GB:.1f}-{high / GB:.1f})",
                f"x{row['of_copy']:.3f} (x{r_low:.3f}-x{r_high:.3f})"]

    head = ["collective", "NCCL on 1 rank does", f"{human_bytes(rows[0]['small']['size_bytes'])}: us (IQR)",
            f"{human_bytes(rows[0]['large']['size_bytes'])}: us (IQR)", "algbw GB/s (IQR)",
            f"/ {copy['name']} (spread)"]
    table = [head] + [cells(row) for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in
                               enumerate(zip(line, widths))).rstrip() for line in table)


def one_gpu_figures(alone: dict, shared: dict) -> dict:
    """The figures one GPU measures, each (median, (low, high), unit), for headlines and docs/measurements.md:
    NCCL's fixed cost per call (the smallest in-place all-reduce on one rank, IQR), the device copy rate (IQR),
    NCCL's one-rank copy over it (the largest all-gather, spread of both), gloo's best all-reduce busbw between
    two ranks sharing the GPU (IQR)."""
    copy = alone["ceilings"]["device_copy"]
    rows = {row["collective"]: row for row in one_rank_rows(alone["records"], copy)}
    call, gather = rows["all_reduce"]["small"], rows["all_gather"]
    best = peak(shared["records"])
    return {
        f"NCCL call on 1 rank (all_reduce of {human_bytes(call['size_bytes'])}, in place)":
            (call["median_s"] * 1e6, (call["q1_s"] * 1e6, call["q3_s"] * 1e6), "us"),
        f"{copy['name']} rate ({human_bytes(copy['size_bytes'])}, S/t)":
            (copy["rate"] / GB, tuple(v / GB for v in _iqr_rate(copy)), "GB/s"),
        f"NCCL all_gather on 1 rank ({human_bytes(gather['large']['size_bytes'])}) / {copy['name']}":
            (gather["of_copy"], gather["of_copy_spread"], "x"),
        f"gloo all_reduce of CUDA tensors, 2 ranks on 1 GPU, best busbw ({human_bytes(best['size_bytes'])})":
            (best["busbw"] / GB, tuple(v / GB for v in _iqr_rate(best, best["factor"])), "GB/s"),
    }


def one_gpu_report(alone: dict, shared: dict, world_size: int) -> str:
    """What one GPU can and cannot show, from `sweep` at world size 1 under NCCL (`alone`, with the
    ceilings) and two gloo ranks sharing the GPU (`shared`): NCCL's one-rank table against the device copy rate
    (HBM), gloo's table against loopback TCP (its transport between the ranks), then a can / cannot table whose
    figures come from `one_gpu_figures` (median and interval, ready for docs/measurements.md)."""
    copy, tcp = alone["ceilings"]["device_copy"], alone["ceilings"]["tcp"]
    figures = list(one_gpu_figures(alone, shared).items())

    def measured(i):
        name, (value, (low, high), unit) = figures[i]
        return f"measured: {value:.4g} {unit} ({low:.4g}-{high:.4g}), {name}"

    can = [("NCCL's fixed cost of a call", measured(0)),
           ("the GPU's copy rate (HBM), the ceiling of any collective on it", measured(1)),
           ("NCCL's one-rank copy against the GPU's copy rate", measured(2)),
           ("gloo moving CUDA tensors through host memory", measured(3)),
           ("NCCL's busbw between GPUs (NVLink, PCIe, network)", "cannot: at world size 1 nothing crosses a link "
                                                                 "(busbw factor 0); it needs two GPUs"),
           ("NCCL against gloo on the same GPUs", "cannot: NCCL refuses two ranks on one GPU"),
           ("busbw against the number of ranks", "cannot with NCCL; the multi-rank sweep above ran gloo on CPU "
                                                  f"({world_size} ranks)")]
    width = max(len(what) for what, _ in can)
    return "\n".join([
        format_ceilings({"device_copy": copy, "tcp": tcp}), "",
        "NCCL on one rank (world size 1): busbw is 0 or meaningless there; the time and the copy are what it shows",
        one_rank_table(one_rank_rows(alone["records"], copy), copy), "",
        "gloo, two ranks sharing the GPU (CUDA tensors staged through host memory):",
        format_table(shared["records"], tcp), "",
        f"{'what one GPU can and cannot show':<{width}}  here", *(f"{what:<{width}}  {got}" for what, got in can)])


def peak(records: list[dict], key: str = "busbw") -> dict:
    """The record with the highest `key` (bandwidth) among `records`."""
    return max(records, key=lambda r: r[key])


def smallest(records: list[dict]) -> dict:
    """The record of the smallest message: its time is the collective's latency."""
    return min(records, key=lambda r: r["size_bytes"])


def environment_note() -> str:
    """One line of context for a benchmark table: threads, cores, host."""
    return (f"host {socket.gethostname()}, {usable_cores()} usable cores, OMP_NUM_THREADS="
            f"{os.environ.get('OMP_NUM_THREADS', 'unset')}")
