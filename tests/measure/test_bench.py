"""Unit tests of helpers.measure.collectives and helpers.measure.ceilings: the nccl-tests arithmetic, the statistics,
the ceilings, and time_collective on real ranks (including a collective whose result is wrong, which the closed-form
check must catch)."""
from __future__ import annotations


import pytest
import torch.distributed as dist

import helpers
from helpers.measure import collectives as bench
from helpers.measure.ceilings import (best_ceilings, human_bytes, loopback_tcp_latency, loopback_tcp_rate,
                                      measure_ceilings, memory_copy_rate, transport_facts)
from helpers.paths import NOTEBOOKS, SCRIPTS


def _sweep():
    """Notebook 01b's worker `sweep`, read from its cell, with its own `time_collective` and the plumbing both are
    handed bound in: sweep(sizes, warmup, repeats, measure_ceilings=None, ...)."""
    import functools
    import json

    cells = json.loads((NOTEBOOKS / "01b_backends_and_bandwidth.ipynb").read_text())["cells"]
    namespace = {"bench": bench}
    for cell_id in ("time-collective", "sweep-worker"):
        source = "".join(next(c for c in cells if c.get("id") == cell_id)["source"])
        exec(compile(source, f"01b_backends_and_bandwidth.ipynb:{cell_id}", "exec"), namespace)
    return functools.partial(_bound_sweep, namespace["sweep"], namespace["time_collective"])


def _bound_sweep(sweep, time_collective, sizes, warmup, repeats, *args, **kwargs):
    return sweep(sizes, warmup, repeats, time_collective, bench.SWEEP_PLUMBING, *args, **kwargs)


@pytest.mark.parametrize("name, n, factor", [
    ("all_reduce", 2, 1.0), ("all_reduce", 4, 1.5), ("all_reduce", 8, 1.75), ("all_reduce", 1, 0.0),
    ("all_gather", 2, 0.5), ("all_gather", 4, 0.75), ("reduce_scatter", 2, 0.5), ("reduce_scatter", 4, 0.75),
    ("all_to_all", 2, 0.5), ("all_to_all", 4, 0.75), ("broadcast", 2, 1.0), ("broadcast", 4, 1.0),
    ("reduce", 4, 1.0),
])
def test_busbw_factor_matches_nccl_tests(name, n, factor):
    assert bench.busbw_factor(name, n) == factor


def test_busbw_factor_aliases_and_errors():
    assert bench.busbw_factor("all_gather_into_tensor", 4) == bench.busbw_factor("all_gather_single", 4) == 0.75
    assert bench.busbw_factor("reduce_scatter_tensor", 2) == 0.5
    assert bench.busbw_factor("all_to_all_single", 4) == 0.75
    with pytest.raises(ValueError):
        bench.busbw_factor("all_reduse", 2)
    with pytest.raises(ValueError):
        bench.busbw_factor("all_reduce", 0)


def test_algbw_and_busbw():
    assert bench.algbw(1e9, 0.5) == 2e9
    assert bench.busbw("all_reduce", 4, 1e9, 0.5) == 3e9
    assert bench.busbw("all_gather", 2, 1e9, 1.0) == 0.5e9


def test_size_sweep():
    assert bench.size_sweep(1024, 64 << 20, 4) == [1024 * 4 ** k for k in range(9)]
    assert bench.size_sweep(1024, 5000, 2) == [1024, 2048, 4096]
    assert bench.size_sweep(8, 8) == [8]
    with pytest.raises(ValueError):
        bench.size_sweep(100, 10)
    with pytest.raises(ValueError):
        bench.size_sweep(1, 10, 1)


def test_oversubscription_warning():
    assert bench.oversubscription_warning(2, cores=2) is None
    text = bench.oversubscription_warning(4, cores=2)
    assert text and "4 ranks" in text and "2 CPU cores" in text and "scheduler" in text


def test_best_ceilings_keeps_the_best_of_each():
    first = {"tcp": {"kind": "bandwidth", "rate": 2.0}, "lat": {"kind": "latency", "latency_s": 3e-5}}
    second = {"tcp": {"kind": "bandwidth", "rate": 3.0}, "lat": {"kind": "latency", "latency_s": 5e-5}}
    best = best_ceilings(first, second)
    assert best["tcp"]["rate"] == 3.0 and best["lat"]["latency_s"] == 3e-5 and best["tcp"]["of_runs"] == 2


def test_ceilings_are_measured():
    copy = memory_copy_rate(4 << 20, repeats=3)
    assert copy["rate"] > 0 and copy["traffic"] == 2 * copy["rate"] and len(copy["times_s"]) == 3
    tcp = loopback_tcp_rate(4 << 20, repeats=2, chunk=1 << 20)
    assert tcp["rate"] > 0 and tcp["size_bytes"] == 4 << 20 and len(tcp["times_s"]) == 2
    latency = loopback_tcp_latency(repeats=20)
    assert 0 < latency["latency_s"] < 0.1 and len(latency["times_s"]) == 20


def test_format_table_warns_when_oversubscribed():
    record = {"collective": "all_reduce", "backend": "gloo", "world_size": 4, "size_bytes": 1024, "median_s": 1e-3,
              "q1_s": 9e-4, "q3_s": 2e-3, "algbw": 1.024e6, "busbw": 1.536e6, "cores": 2, "oversubscribed": True}
    text = bench.format_table([record], {"name": "loopback TCP", "rate": 1.536e9})
    assert text.splitlines()[0].startswith("WARNING") and "0.1%" in text


def _sweep_worker(names, sizes):
    import torch.distributed as dist

    dist.init_process_group(backend="gloo")
    records = [r for name in names for r in bench.time_collective(name, sizes, warmup=1, repeats=3)]
    dist.destroy_process_group()
    return records


def test_time_collective_on_two_ranks():
    sizes = [1000, 1 << 16]
    results = helpers.launch(_sweep_worker, list(bench.COLLECTIVES), sizes, world_size=2, timeout=120, quiet=True)
    assert results[0] == results[1], "every rank must return the same records"
    records = results[0]
    assert len(records) == len(bench.COLLECTIVES) * len(sizes)
    for r in records:
        assert r["checked"] and r["world_size"] == 2 and r["backend"] == "gloo" and len(r["times_s"]) == 3
        assert r["size_bytes"] % (2 * 4) == 0 and r["size_bytes"] <= max(sizes)  # whole float32s, divisible by n
        assert r["min_s"] <= r["q1_s"] <= r["median_s"] <= r["q3_s"] <= r["max_s"]
        assert r["busbw"] == pytest.approx(r["size_bytes"] / r["median_s"] * bench.busbw_factor(r["collective"], 2))
        assert r["busbw_q1"] <= r["busbw"] <= r["busbw_q3"]
        assert r["timing"].startswith("first start to last end")


def test_single_tensor_collectives_fall_back_to_the_older_names(monkeypatch):
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)
    assert bench.single_tensor_collectives() == (dist.all_gather_into_tensor, dist.reduce_scatter_tensor)


def _without_the_213_names_worker(sizes):
    import torch.distributed as dist

    for name in ("all_gather_single", "reduce_scatter_single"):  # as in torch 2.11
        if hasattr(dist, name):
            delattr(dist, name)
    dist.init_process_group(backend="gloo")
    records = [r for name in ("all_gather", "reduce_scatter") for r in bench.time_collective(name, sizes, warmup=1,
                                                                                             repeats=2)]
    dist.destroy_process_group()
    return records


def test_time_collective_works_without_all_gather_single():
    records = helpers.launch(_without_the_213_names_worker, [1 << 12], world_size=2, timeout=120, quiet=True)[0]
    assert [r["collective"] for r in records] == ["all_gather", "reduce_scatter"] and all(r["checked"] for r in records)


def test_the_sweep_measures_every_collective_and_the_ceilings():
    results = helpers.launch(_sweep(), [1 << 10, 1 << 14], 1, 2, measure_ceilings,
                             world_size=2, timeout=180, quiet=True)
    assert results[0]["records"] == results[1]["records"] and results[1]["ceilings"] == []
    assert [r["collective"] for r in results[0]["records"]] == [c for c in bench.COLLECTIVES for _ in range(2)]
    ceilings = best_ceilings(*results[0]["ceilings"])  # rank 0's, before and after the sweep
    assert set(ceilings) == {"tcp", "memcpy", "tcp_latency"} and all(c["of_runs"] == 2 for c in ceilings.values())


def test_transport_facts_reads_this_machine():
    facts = transport_facts()
    assert set(facts) == {"tcp_rmem", "rmem_max", "infiniband", "numa_nodes", "numactl", "cores"}
    assert facts["tcp_rmem"] is None or len(facts["tcp_rmem"]) == 3


def test_human_bytes():
    assert [human_bytes(v) for v in (512, 1024, 1536, 1 << 30)] == ["512 B", "1 KiB", "1.5 KiB", "1 GiB"]


def _broken_check_worker():
    import torch.distributed as dist

    dist.init_process_group(backend="gloo")
    bench._operation = lambda *args, **kwargs: (lambda: None)  # a "collective" that does nothing
    bench.time_collective("all_reduce", [1024], warmup=0, repeats=1)


def test_time_collective_catches_a_wrong_result():
    with pytest.raises(helpers.WorkerError) as info:
        helpers.launch(_broken_check_worker, world_size=2, timeout=60, quiet=True)
    assert info.value.kind == "AssertionError" and "closed form" in info.value.message


def _span_worker():
    import torch.distributed as dist

    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    starts = [[0.0, 10.0], [0.5, 10.2]][rank]
    ends = [[1.0, 11.0], [2.0, 10.5]][rank]
    times, how = bench._per_call_times(starts, ends, None, __import__("torch").device("cpu"))
    dist.destroy_process_group()
    return times, how


def test_per_call_time_is_first_start_to_last_end_on_one_host():
    for times, how in helpers.launch(_span_worker, world_size=2, timeout=60, quiet=True):
        assert times == [2.0, 1.0] and "one host" in how


def _record(collective, size, times, factor=1.0, world_size=2, device="cpu", backend="gloo"):
    from helpers.measure.timing import summarize

    stats = summarize(times)
    return {"collective": collective, "backend": backend, "device": device, "world_size": world_size,
            "size_bytes": size, "factor": factor, "times_s": list(times), **stats,
            "algbw": size / stats["median_s"], "busbw": size / stats["median_s"] * factor, "cores": 2,
            "oversubscribed": False, "checked": True}


def test_reading_helpers_carry_the_spread_of_the_repeats():
    rows = [_record("all_reduce", 1000, [1e-3, 2e-3, 4e-3]), _record("all_reduce", 10**6, [1e-3, 1e-3, 2e-3])]
    share, (low, high) = bench.share_of_peak(rows)
    assert share == pytest.approx(100 * (1000 / 2e-3) / 1e9) and low < share < high
    assert high == pytest.approx(100 * (1000 / 1e-3) / 1e9)
    copy = {"size_bytes": 10**6, "median_s": 5e-4, "min_s": 4e-4, "max_s": 1e-3}
    ratio, (low, high) = bench.ratio_to_ceiling(rows[1], copy)
    assert ratio == pytest.approx(0.5) and low == pytest.approx(0.2) and high == pytest.approx(1.0)


def _one_gpu_runs():
    """Made-up results of notebook 01b's one-GPU runs as NCCL on one H100-like GPU would give them: in-place calls take 20 us
    at any size (NCCL does nothing), out-of-place ones copy S at 800 GB/s, the device copies at 1000 GB/s."""
    t = (1 << 30) / 1e12
    copy = {"name": "cuda memory copy", "kind": "bandwidth", "size_bytes": 1 << 30, "rate": 1e12, "median_s": t,
            "q1_s": t, "q3_s": t, "min_s": 0.9 * t, "max_s": 1.1 * t, "times_s": [t] * 3, "counts": "S/t"}
    tcp = {"name": "loopback TCP", "kind": "bandwidth", "size_bytes": 1 << 26, "rate": 2e9, "median_s": 0.0336,
           "q1_s": 0.0336, "q3_s": 0.0336, "times_s": [0.0336], "counts": "S/t"}
    records = [_record(name, size, [2e-5] * 3 if name in bench.IN_PLACE else [size / 8e11] * 3,
                       factor=bench.busbw_factor(name, 1), world_size=1, device="cuda", backend="nccl")
               for name in bench.COLLECTIVES for size in (1024, 1 << 30)]
    alone = {"records": records, "ceilings": {"device_copy": copy, "tcp": tcp}}
    shared = {"records": [_record("all_reduce", 1024, [1e-3] * 3, device="cuda"),
                          _record("all_reduce", 1 << 20, [2e-3] * 3, device="cuda")]}
    return alone, shared


def test_one_rank_rows_read_copies_against_the_device_copy_rate_and_in_place_calls_as_fixed_cost():
    alone, _ = _one_gpu_runs()
    copy = alone["ceilings"]["device_copy"]
    # busbw cannot be read on one rank: 0 (factor 0), or a no-op broadcast "faster" than the GPU's memory
    broadcast = max((r for r in alone["records"] if r["collective"] == "broadcast"), key=lambda r: r["size_bytes"])
    assert broadcast["busbw"] > 10 * copy["rate"]
    rows = {row["collective"]: row for row in bench.one_rank_rows(alone["records"], copy)}
    assert list(rows) == list(bench.COLLECTIVES)
    for name in bench.IN_PLACE:
        assert rows[name]["in_place"] and "of_copy" not in rows[name]
    for name in ("all_gather", "reduce_scatter", "all_to_all"):
        assert rows[name]["algbw"] == pytest.approx(8e11) and rows[name]["of_copy"] == pytest.approx(0.8)
        low, high = rows[name]["of_copy_spread"]
        assert low == pytest.approx(0.8 * 0.9) and high == pytest.approx(0.8 * 1.1)  # copy slowest/fastest
    table = bench.one_rank_table(list(rows.values()), copy)
    assert table.splitlines()[0].startswith("collective") and len(table.splitlines()) == 1 + len(rows)
    assert [line.split()[-1] for line in table.splitlines()[1:] if line.split()[0] in bench.IN_PLACE] == ["-"] * 3


def test_one_gpu_report_says_what_one_gpu_can_and_cannot_show():
    alone, shared = _one_gpu_runs()
    figures = bench.one_gpu_figures(alone, shared)
    # the fixed cost, the device copy rate, NCCL's copy over it, gloo's best busbw, each with its unit
    assert [(value, unit) for value, _, unit in figures.values()] == [
        (pytest.approx(20.0), "us"), (pytest.approx(1000), "GB/s"), (pytest.approx(0.8), "x"),
        (pytest.approx((1 << 20) / 2e-3 / 1e9), "GB/s")]
    assert all(low <= value <= high for value, (low, high), _ in figures.values())
    text = bench.one_gpu_report(alone, shared, 2)
    assert "cannot show" in text and "gloo on CPU (2 ranks)" in text and "% of loopback TCP" in text
    assert "measured: 20 us" in text and "measured: 0.8 x" in text


def test_one_gpu_report_reads_real_sweep_records():
    """The one-GPU cell's reading, fed with real `sweep` results of the same shape (gloo on CPU here; on a GPU
    machine notebook 01b runs NCCL at world size 1 on cuda:0, whose ceilings add the device copy)."""
    from helpers.plots import collectives as plots

    sweep = _sweep()
    alone = helpers.launch(sweep, [1 << 10, 1 << 16], 1, 3, measure_ceilings,
                           world_size=1, timeout=180, quiet=True)[0]
    alone["ceilings"] = best_ceilings(*alone["ceilings"])
    shared = helpers.launch(sweep, [1 << 10], 1, 3, collectives=("all_reduce",),
                            world_size=2, timeout=180, quiet=True)[0]
    alone["ceilings"]["device_copy"] = alone["ceilings"]["memcpy"]  # what a CPU has in place of HBM
    rows = bench.one_rank_rows(alone["records"], alone["ceilings"]["device_copy"])
    assert [row["collective"] for row in rows] == list(bench.COLLECTIVES)
    assert all(row["large"]["size_bytes"] == 1 << 16 and row["small"]["size_bytes"] == 1 << 10 for row in rows)
    figures = bench.one_gpu_figures(alone, shared)
    assert len(figures) == 4 and all(low <= value <= high for value, (low, high), _ in figures.values())
    assert "cannot show" in bench.one_gpu_report(alone, shared, 2)
    plots.one_rank(alone["records"], alone["ceilings"]["device_copy"])


def test_the_sweep_runs_at_each_world_size():
    records = [r for n in (1, 2) for r in helpers.launch(_sweep(), [1 << 12], 1, 2, collectives=(
        "all_reduce", "all_gather"), world_size=n, timeout=120, quiet=True)[0]["records"]]
    assert [(r["world_size"], r["collective"]) for r in records] == [
        (1, "all_reduce"), (1, "all_gather"), (2, "all_reduce"), (2, "all_gather")]
    assert all(r["checked"] and r["factor"] == bench.busbw_factor(r["collective"], r["world_size"]) for r in records)


def test_the_scripts_detail_cost_compares_checked_and_unchecked_groups():
    import importlib.util

    spec = importlib.util.spec_from_file_location("collectives_script", SCRIPTS / "collectives.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    results = helpers.launch(script.detail_cost, 3, 5, world_size=2, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
                             timeout=120, quiet=True)
    assert all(r["debug_level"] == "DebugLevel.DETAIL" and len(r["detail_s"]) == len(r["off_s"]) == 3
               and min(r["detail_s"] + r["off_s"]) > 0 for r in results)


def test_the_sweep_can_skip_the_ceilings():
    results = helpers.launch(_sweep(), [1 << 12], 1, 2, collectives=("reduce_scatter",),
                             world_size=2, timeout=120, quiet=True)
    assert [r["ceilings"] for r in results] == [[], []]
    assert [(r["collective"], r["size_bytes"], r["checked"]) for r in results[0]["records"]] == \
        [("reduce_scatter", 1 << 12, True)]


@pytest.mark.skipif(helpers.devices.gpu_count() != 1, reason="the one-GPU runs need exactly one GPU")
def test_the_one_gpu_runs_time_nccl_alone_and_gloo_sharing_the_gpu():
    alone = helpers.launch(_sweep(), [1 << 10, 1 << 16], 1, 2, bench.measure_ceilings, backend="nccl", world_size=1,
                           timeout=180, quiet=True)[0]
    alone["ceilings"] = bench.best_ceilings(*alone["ceilings"])
    shared = helpers.launch(_sweep(), [1 << 10], 1, 2, collectives=("all_reduce",), device="cuda:0",
                            group_backend="gloo", backend="gloo", world_size=2, timeout=180, quiet=True)[0]
    assert {(r["backend"], r["device"], r["world_size"]) for r in alone["records"]} == {("nccl", "cuda", 1)}
    assert [(r["backend"], r["device"], r["size_bytes"]) for r in shared["records"]] == [("gloo", "cuda", 1 << 10)]
    assert "device_copy" in alone["ceilings"] and shared["ceilings"] == []
    assert "cannot show" in bench.one_gpu_report(alone, shared, 2)
