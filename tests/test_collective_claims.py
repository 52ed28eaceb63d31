"""helpers.measure.collective_claims: each judgement reads the right records, computes its figure by the formula
it states, and words the verdict from the measurement's spread; helpers.plots.collectives.explored_point and
before_after."""
from __future__ import annotations

import matplotlib
import pytest

matplotlib.use("Agg")

from helpers.measure import collective_claims as judge  # noqa: E402
from helpers.measure.collectives import busbw_factor  # noqa: E402
from helpers.measure.timing import summarize  # noqa: E402

FACTS = {"gpus": 0, "gpu_names": [], "mpi": False}


def _record(collective, size, times, backend="gloo", device="cpu", world_size=2):
    stats = summarize(times)
    factor = busbw_factor(collective, world_size)
    return {"collective": collective, "backend": backend, "device": device, "world_size": world_size,
            "size_bytes": size, "factor": factor, "times_s": list(times), **stats,
            "algbw": size / stats["median_s"], "busbw": size / stats["median_s"] * factor,
            "busbw_q1": size / stats["q3_s"] * factor, "busbw_q3": size / stats["q1_s"] * factor,
            "cores": 2, "oversubscribed": False, "checked": True}


def test_time_saved_is_the_per_round_share_of_the_slower_time():
    assert judge.time_saved([2.0, 4.0], [1.0, 3.0]) == [50.0, 25.0]


def test_threads_verdict_from_side_by_side_rounds():
    run = {"times_s": {1: [2e-6] * 5, 4: [1e-6] * 5}, "size_bytes": 1024, "world_size": 2}
    net = {"cores": 2, "numa_nodes": 1, "numactl": None}
    text = judge.threads_and_numactl(run, net)
    assert "1 thread 2.0 us, 4 threads 1.0 us; time saved with 4: 50.0%" in text and "above the claimed 22%" in text
    assert "8 threads on 2 cores (more threads than cores" in text
    assert "verdict (numactl): not comparable here: 1 NUMA node" in text


def test_bandwidth_delay_product_is_rate_times_round_trip():
    ceilings = {"tcp": {"rate": 2e9}, "tcp_latency": {"latency_s": 5e-6}}
    assert judge.bandwidth_delay_product(ceilings) == pytest.approx((2e4, 1e-5))
    net = {"tcp_rmem": [4096, 131072, 6291456], "rmem_max": 212992}
    text = judge.tcp_rmem((4096, 87380, 2147483647), net, ceilings)
    assert "19.5 KiB in flight" in text and "the buffer cap is not the limit" in text and "not comparable" in text


def test_backend_table_reads_latency_and_bandwidth_of_the_all_reduce():
    rows = [_record("all_reduce", 1024, [2e-3] * 5), _record("all_reduce", 10**6, [1e-3] * 5),
            _record("all_gather", 10**6, [1e-6] * 5)]  # another collective: not read
    claimed = {"nccl": {"latency_ms": (1, 3)}, "gloo": {"latency_ms": (5, 10), "bandwidth_GBps": (5, 10)}}
    text = judge.backend_table(rows, claimed, FACTS)
    assert "nccl: not comparable here: the claim is NCCL between V100/A100 GPUs; that needs two GPUs, this " \
           "machine has 0" in text
    latency, bandwidth = (line for line in text.splitlines() if line.startswith("  "))
    assert "measured 2 (2-2)" in latency and "below the claimed 5-10" in latency
    # the best busbw: 1e6 bytes in 1 ms with the all-reduce factor 2(n-1)/n = 1 at n = 2
    assert "measured 1 (1-1)" in bandwidth and "below the claimed 5-10" in bandwidth


def test_gloo_against_nccl_at_the_largest_common_size():
    rows = [_record("all_reduce", s, [t] * 3, backend=b, device="cuda") for s, t, b in
            ((1024, 1e-5, "nccl"), (1 << 20, 1e-4, "nccl"), (1 << 30, 1e-2, "nccl"),
             (1024, 1e-4, "gloo"), (1 << 20, 1e-3, "gloo"))]
    text = judge.gloo_rather_than_nccl(rows, {**FACTS, "gpus": 2})
    assert "all_reduce of 1 MiB: nccl 0.100 ms, gloo 1.000 ms" in text and "above the claimed 0-1x (10x" in text
    assert "not comparable here" in judge.gloo_rather_than_nccl([r for r in rows if r["backend"] == "gloo"], FACTS)


def test_one_gpu_puts_gloo_on_cuda_tensors_beside_cpu_tensors():
    cpu = [_record("all_reduce", 1 << 20, [1e-3] * 3)]  # the multi-rank sweep: gloo on CPU
    shared = {"records": [_record("all_reduce", 1 << 20, [4e-3] * 3, device="cuda")]}  # two gloo ranks on one GPU
    text = judge.gloo_rather_than_nccl(cpu, {**FACTS, "gpus": 1}, shared)
    assert "this machine has 1" in text and "1 MiB: CUDA tensors    4.000 ms, CPU tensors    1.000 ms" in text


def test_latency_bound_share_and_memory_copy_ratio():
    rows = [_record("all_reduce", 1000, [1e-3] * 3), _record("all_reduce", 10**6, [1e-3] * 3)]
    text = judge.latency_bound(rows, "gloo")
    assert "all_reduce        0.10% -> within the claimed 0-20%" in text  # 1e3/1e-3 against 1e6/1e-3
    copy = {"name": "cpu memory copy", "size_bytes": 10**6, "median_s": 5e-4, "min_s": 5e-4, "max_s": 5e-4}
    assert "x0.500 -> within the claimed 0-1x" in judge.below_memory_copy(rows, copy, "gloo")


def test_ring_saving_is_one_minus_the_busiest_links_ratio():
    assert judge.RING_SAVING["server on rank 0"](4) == pytest.approx(50.0)       # 4(n-1)/n S against 2(n-1) S
    assert judge.RING_SAVING["dedicated server"](4) == pytest.approx(62.5)       # 3 S against 8 S
    text = judge.ring_saving(75.0, 8)
    assert "server on rank 0    0.0%  33.3%  50.0%  66.7%  75.0%  87.5%  96.9%   within the claim for n in [4, 6]" \
        in text
    assert "within the claim for n in [2, 3, 4]" in text  # the dedicated server
    assert "(8 ranks, server on rank 0): above the claimed 50-70%" in text


def test_detail_cost_ratio():
    text = judge.detail_cost({"ratios": [2.0] * 5, "detail_s": 2e-5, "off_s": 1e-5})
    assert "20 us with DETAIL, 10 us without" in text and "ratio x2.00" in text
    assert "within the claimed 1x or more" in text


def test_explored_point_stars_one_point_on_its_collectives_curve():
    from helpers.plots.collectives import explored_point

    sweep = [_record("all_reduce", s, [s / 1e9 + 1e-5] * 3) for s in (1024, 1 << 16, 1 << 20)]
    sweep += [_record("all_gather", 1 << 16, [1e-4] * 3)]  # another collective: not drawn
    point = _record("all_reduce", 1 << 18, [3e-4, 4e-4, 5e-4])
    fig = explored_point(sweep, point, {"kind": "bandwidth", "rate": 2e9, "name": "loopback TCP"})
    bandwidth, latency = fig.axes
    drawn = {ax: {c.get_label(): c.lines[0] for c in ax.containers} for ax in (bandwidth, latency)}  # errorbars
    curve, star = drawn[bandwidth]["the sweep above"], drawn[bandwidth]["this press"]
    assert list(curve.get_xdata()) == [1024, 1 << 16, 1 << 20] and list(star.get_xdata()) == [1 << 18]
    assert star.get_ydata()[0] == pytest.approx(point["busbw"] / 1e9)
    assert drawn[latency]["this press"].get_ydata()[0] == pytest.approx(4e-4 * 1e6)


def test_before_after_draws_each_ranks_tensors_and_a_dash_for_none():
    import torch

    from helpers.plots.collectives import before_after

    per_rank = [{"reduce(dst=0)": (torch.tensor([10.0, 11.0]), torch.tensor([30.0, 32.0]))},
                {"reduce(dst=0)": (torch.tensor([20.0, 21.0]), None)}]
    fig = before_after(per_rank)
    cells = fig.axes[0].tables[0].get_celld()
    assert [cells[1, j].get_text().get_text() for j in range(4)] == ["[10 11]", "[20 21]", "[30 32]", "-"]
    assert cells[1, -1].get_text().get_text() == "reduce(dst=0)"
