"""The seed articles' claims on collectives, backends, the network and threads, judged from what notebooks 01 and
01b measured.

Why a module: each judgement is bookkeeping around one measurement (pick the records the claim is about, take
the interval its repeats support, print the claim's setting beside this machine's, call `claims.verdict`). Kept
here, the notebook's claim cells show the claim and the measurement they rest on, and print the lines these
functions return. Every function takes results already measured (`collectives.sweep_worker`'s records and
ceilings, `intra_op_threads_worker`, `detail_cost_worker`, `transport_facts`, `helpers.describe_machine()`, the
bytes notebook 01's ring counted) and returns text: nothing here measures, so each can be tested with made-up records.
"""
from __future__ import annotations

import statistics

from helpers.measure.claims import median_interval, verdict
from helpers.measure.collectives import COLLECTIVES, GB, human_bytes, latency_and_bandwidth, peak, \
    ratio_to_ceiling, share_of_peak


def _all_reduce(records: list[dict], backend: str) -> list[dict]:
    return [r for r in records if r["collective"] == "all_reduce" and r["backend"] == backend]


def detail_cost(cost: dict) -> str:
    """'DETAIL costs time on every collective' from `detail_cost_worker`'s side-by-side rounds (x1 or more)."""
    ratios = cost["ratios"]
    median, spread = statistics.median(ratios), median_interval(ratios)
    return "\n".join([
        f"one small all_reduce: {cost['detail_s'] * 1e6:.0f} us with DETAIL, {cost['off_s'] * 1e6:.0f} us without "
        f"(rank 0); ratio x{median:.2f} (interval x{spread[0]:.2f}-x{spread[1]:.2f}, {len(ratios)} rounds)",
        "'DETAIL costs time on every collective' (x1 or more): "
        + verdict(median, 1.0, None, unit="x", spread=spread)])


RING_SAVING = {  # % less traffic on the busiest link in a ring all-reduce than with a parameter server, for n ranks
    "server on rank 0": lambda n: 100 * (1 - 2 / n),                  # 4(n-1)/n S against 2(n-1) S
    "dedicated server": lambda n: 100 * (1 - 2 * (n - 1) / n ** 2),   # 4(n-1)/n S against 2n S
}


def ring_saving(measured_pct: float, n: int, claimed: tuple = (50, 70), ns: tuple = (2, 3, 4, 6, 8, 16, 64)) -> str:
    """'Ring all-reduce cuts communication by 50-70% against a parameter server'. The totals are equal, so the
    saving is on the busiest link: tabulated over `ns` for a server on rank 0 and a dedicated one, with the n each
    falls within the claim for, and the verdict at the n measured (`measured_pct`, from the counted bytes)."""
    lines = [f"saving on the busiest link, n = {ns}, claim {claimed[0]}-{claimed[1]}%:"]
    for model, formula in RING_SAVING.items():
        inside = [k for k in ns if verdict(formula(k), *claimed).startswith("within")]
        lines.append(f"  {model:<17}" + "".join(f"{formula(k):6.1f}%" for k in ns)
                     + f"   within the claim for n in {inside}")
    lines.append(f"verdict at the n measured ({n} ranks, server on rank 0): "
                 f"{verdict(measured_pct, *claimed, unit='%')}; the saving is not a constant, it depends on n and "
                 "on where the server lives")
    return "\n".join(lines)


def latency_bound(records: list[dict], backend: str) -> str:
    """'Small messages are latency-bound': per collective, the smallest message's busbw as a share of the best,
    judged against 20% with the spread of its slowest and fastest repeat."""
    lines = ["'small messages are latency-bound: the smallest reaches under 20% of the best busbw' (spread: its "
             "slowest and fastest repeat)"]
    for name in COLLECTIVES:
        rows = [r for r in records if r["collective"] == name and r["backend"] == backend]
        if rows:
            share, spread = share_of_peak(rows)
            lines.append(f"  {name:<15} {share:6.2f}% -> {verdict(share, 0, 20, unit='%', spread=spread)}")
    return "\n".join(lines)


def below_memory_copy(records: list[dict], copy: dict, backend: str) -> str:
    """'No transport between processes beats a memory copy': the best busbw over the copy rate (x1 at most)."""
    best = peak([r for r in records if r["backend"] == backend])
    ratio, spread = ratio_to_ceiling(best, copy)
    return (f"'no transport between processes beats a memory copy': best busbw ({best['collective']}, "
            f"{human_bytes(best['size_bytes'])}) / {copy['name']} of {human_bytes(copy['size_bytes'])} = "
            f"x{ratio:.3f} -> {verdict(ratio, 0, 1, unit='x', spread=spread)}")


def backend_table(records: list[dict], claimed: dict, facts: dict) -> str:
    """An article's backend table ({backend: {'latency_ms': (low, high), 'bandwidth_GBps': (low, high)}}) beside
    each backend's all-reduce measured here: latency as the smallest message's median time, bandwidth as the best
    busbw, each with the bootstrap interval of its median. A backend not timed here says why."""
    why_not = {"nccl": f"the claim is NCCL between V100/A100 GPUs; that needs two GPUs, this machine has "
                       f"{facts['gpus']}",
               "mpi": "this PyTorch has no MPI backend" if not facts["mpi"] else "MPI was not timed in this run"}
    lines = []
    for backend, claim in claimed.items():
        rows = _all_reduce(records, backend)
        if not rows:
            reason = why_not.get(backend, f"{backend} was not timed in this run")
            lines.append(f"{backend}: {verdict(None, 0, None, applicable=False, reason=reason)}")
            continue
        figures = latency_and_bandwidth(rows)
        lines.append(f"{backend}: {figures['context']}")
        for quantity, (low, high) in claim.items():
            got, spread = figures[quantity]
            lines.append(f"  {quantity:<15} claim {low:g}-{high:g}   measured {got:.4g} ({spread[0]:.4g}-"
                         f"{spread[1]:.4g})   -> {verdict(got, low, high, spread=spread)}")
    return "\n".join(lines)


def gloo_rather_than_nccl(records: list[dict], facts: dict, shared: dict | None = None) -> str:
    """'gloo rather than NCCL on rented GPU servers': with two GPUs or more, gloo's time over NCCL's on the same
    CUDA tensors at the largest size both timed (x1 at most would support it); with one GPU, gloo's trip through
    the host (`shared`: two gloo ranks on one GPU) beside the CPU tensors' times; without a GPU, not comparable."""
    lines = ["advice: gloo rather than NCCL on rented GPU servers ('providers use heterogeneous GPUs')",
             f"  its setting: rented (VPS) GPU servers | this machine: {facts['gpus']} GPU(s) {facts['gpu_names']}"]
    nccl_rows, gloo_rows = _all_reduce(records, "nccl"), _all_reduce(records, "gloo")
    both = {r["size_bytes"] for r in nccl_rows} & {r["size_bytes"] for r in gloo_rows}
    if both:
        size = max(both)
        nccl, gloo = (next(r for r in rows if r["size_bytes"] == size) for rows in (nccl_rows, gloo_rows))
        spread = (gloo["min_s"] / nccl["max_s"], gloo["max_s"] / nccl["min_s"])
        lines += [f"  all_reduce of {human_bytes(size)}: nccl {nccl['median_s'] * 1e3:.3f} ms, gloo "
                  f"{gloo['median_s'] * 1e3:.3f} ms",
                  "  verdict on 'gloo is no slower than NCCL' (gloo's time / NCCL's at most x1): "
                  + verdict(gloo["median_s"] / nccl["median_s"], 0, 1, unit="x", spread=spread)]
    else:
        lines.append("  verdict: " + verdict(None, 0, 1, applicable=False, reason=f"gloo against NCCL needs two "
                                             f"GPUs, this machine has {facts['gpus']}"))
    for r in (shared or {}).get("records", []):  # one GPU: gloo's trip through the host, CUDA against CPU tensors
        cpu = next((c for c in gloo_rows if c["size_bytes"] == r["size_bytes"] and c["device"] == "cpu"), None)
        on_cpu = f", CPU tensors {cpu['median_s'] * 1e3:8.3f} ms" if cpu else ""
        lines.append(f"  gloo all_reduce of {human_bytes(r['size_bytes']):>9}: CUDA tensors "
                     f"{r['median_s'] * 1e3:8.3f} ms{on_cpu}")
    return "\n".join(lines)


def nccl_ib_disable(net: dict, facts: dict, setting: str | None) -> str:
    """'NCCL_IB_DISABLE=1 markedly lowers cross-node latency': not comparable on one node (`setting`: the
    variable's value here, None when unset)."""
    return "\n".join([
        "advice: NCCL_IB_DISABLE=1 'markedly lowers cross-node latency'",
        f"  its setting: VPS clusters on the US east and west coasts, several nodes | this machine: one node, "
        f"{facts['gpus']} GPU(s), InfiniBand devices: {net['infiniband'] or 'none'}, NCCL_IB_DISABLE="
        f"{setting or 'unset'}",
        "  verdict: " + verdict(None, 0, None, applicable=False, reason="the variable chooses how NCCL crosses "
                                "between nodes (InfiniBand verbs or TCP sockets); one node has no such traffic, and "
                                "where InfiniBand works, TCP sockets add latency rather than remove it")])


def bandwidth_delay_product(ceilings: dict) -> tuple[float, float]:
    """(bytes one loopback TCP stream keeps in flight, round trip in s): the measured stream rate times twice the
    measured one-way latency."""
    round_trip_s = 2 * ceilings["tcp_latency"]["latency_s"]
    return ceilings["tcp"]["rate"] * round_trip_s, round_trip_s


def tcp_rmem(article: tuple, net: dict, ceilings: dict) -> str:
    """'Set net.ipv4.tcp_rmem to `article` for transatlantic throughput': this machine's bandwidth-delay product
    on loopback against its receive-buffer cap (the third number of tcp_rmem)."""
    in_flight, round_trip_s = bandwidth_delay_product(ceilings)
    cap = net["tcp_rmem"][2] if net["tcp_rmem"] else None
    limit = "not the limit" if cap and in_flight < cap else "possibly the limit"
    return "\n".join([
        f"advice: net.ipv4.tcp_rmem = {tuple(article)} 'for transatlantic throughput'",
        f"  its setting: TCP across the Atlantic | this machine: loopback; tcp_rmem = {net['tcp_rmem']}, "
        f"net.core.rmem_max = {net['rmem_max']}",
        f"  loopback here: {ceilings['tcp']['rate'] / GB:.2f} GB/s x {round_trip_s * 1e6:.1f} us round trip = "
        f"{human_bytes(in_flight)} in flight; receive-buffer cap {human_bytes(cap) if cap else 'unknown'}",
        "  verdict: " + verdict(None, 0, None, applicable=False, reason=f"on loopback the buffer cap is {limit} "
                                "(the product is what one stream needs in flight); a larger cap can only show on a "
                                "link whose round trip is long")])


def time_saved(slow: list[float], fast: list[float]) -> list[float]:
    """Per round, the % less time per call of `fast` against `slow` (times measured side by side)."""
    return [100 * (1 - f / s) for s, f in zip(slow, fast)]


def threads_and_numactl(run: dict, net: dict, claimed_pct: float = 22) -> str:
    """'numactl --cpunodebind=0 --membind=0 with torch.set_num_threads(4) cut all-reduce latency by 22%': the
    threads half from `intra_op_threads_worker` run with (1, 4) threads (median saving of the larger count and its
    bootstrap interval); the binding half is measurable only with numactl and two NUMA nodes or more."""
    few, many = min(run["times_s"]), max(run["times_s"])
    slow, fast = run["times_s"][few], run["times_s"][many]
    less = time_saved(slow, fast)
    low, high = median_interval(less)
    threads, nodes = run["world_size"] * many, net["numa_nodes"] or 1
    return "\n".join([
        f"advice: numactl --cpunodebind=0 --membind=0 with torch.set_num_threads(4): all-reduce latency "
        f"-{claimed_pct:g}%",
        f"  its setting: Horovod on AWS EC2 | this machine: {net['cores']} cores, {net['numa_nodes']} NUMA node(s), "
        f"numactl {net['numactl'] or 'not installed'}; {run['world_size']} ranks x {many} threads = {threads} threads "
        f"on {net['cores']} cores" + (" (more threads than cores: the scheduler is part of the figure)"
                                      if threads > net["cores"] else ""),
        f"  all_reduce of {human_bytes(run['size_bytes'])} (gloo, CPU), per call, median over {len(slow)} rounds: "
        f"{few} thread{'s' * (few > 1)} {statistics.median(slow) * 1e6:.1f} us, {many} threads "
        f"{statistics.median(fast) * 1e6:.1f} us; time saved with {many}: {statistics.median(less):.1f}% (interval "
        f"{low:.1f}% to {high:.1f}%)",
        "  verdict (threads): " + verdict(statistics.median(less), claimed_pct, claimed_pct, slack=0.5, unit="%",
                                           spread=(low, high)),
        "  verdict (numactl): " + verdict(None, claimed_pct, claimed_pct, applicable=nodes >= 2 and bool(
            net["numactl"]), reason=f"{nodes} NUMA node here (binding to node 0 binds to all of it); numactl "
                                    f"{net['numactl'] or 'not installed'}")])
