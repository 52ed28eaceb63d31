"""helpers.measure.ddp: its counters against the closed forms; and scripts/ddp_bench.py, notebook 02's cells: DDP's
bucket rule (`bucket_plan`) against DDP itself, and the measuring workers that notebooks 02 and 02b launch."""
from __future__ import annotations

import functools
import math
import os
import random

import pytest
import torch
import torch.distributed as dist

import helpers
from helpers import devices
from helpers.measure import ddp as measure_ddp
from helpers.measure.ddp import PayloadCounter, hook_payload_bytes, powersgd_values
from helpers.measure.trace_overlap import is_gpu_comm, is_gpu_compute, overlap_of_trace
from helpers.paths import SCRIPTS


def _train_ddp():
    """scripts/ddp_bench.py as a module (it imports train_ddp.py beside it), with the recipe's run_distributed: the
    measuring workers (step_times, traced_step, loader_throughput) live there, beside the recipe they time, so
    that a reader's project and the appendix can launch them too."""
    import importlib
    import sys

    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    return importlib.import_module("ddp_bench")


# Notebook 02's model, as its cells define it (scripts/train_ddp.py): the one DigitsMLP of the cookbook; and its
# bucket rule (scripts/ddp_bench.py)
DigitsMLP, bucket_plan = _train_ddp().DigitsMLP, _train_ddp().bucket_plan


def test_digits_mlp_shapes():
    m = DigitsMLP(hidden=32, depth=3)
    assert m(torch.zeros(5, 64)).shape == (5, 10)
    assert sum(p.numel() for p in m.parameters()) == 64 * 32 + 32 + 2 * (32 * 32 + 32) + 32 * 10 + 10


@pytest.mark.parametrize("seed", range(8))
def test_bucket_plan_is_ddps_own_assignment(seed):
    """The rule against the function DDP's reducer rebuilds its buckets with, on the gradients in ready order (the
    reverse of registration) and with the caps DDP passes it: the default's small first bucket, or the cap given."""
    rng = random.Random(seed)
    numels = [rng.choice([1, 10, 300, 5000, 70000]) for _ in range(rng.randint(1, 30))]
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.empty(n)) for n in numels])
    cap = [None, 0.001, 0.01, 0.1, 1, 25][seed % 6]
    limits = [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 2**20] if cap is None else [int(cap * 2**20)]
    ready = [torch.empty(n) for n in reversed(numels)]
    theirs, _ = dist._compute_bucket_assignment_by_size(ready, limits, [False] * len(ready))
    assert bucket_plan(model, cap) == [sum(4 * ready[i].numel() for i in bucket) for bucket in theirs]


def test_bucket_plan_covers_every_parameter_once_and_respects_caps():
    model = DigitsMLP(hidden=512, depth=3)
    total = sum(p.numel() * 4 for p in model.parameters())
    largest = max(p.numel() * 4 for p in model.parameters())
    for cap in (0.01, 0.5, 1, 25):
        plan = bucket_plan(model, cap)
        assert sum(plan) == total
        # every bucket but the last reached the cap, and none overshoots by more than one tensor
        assert all(size >= cap * 2**20 for size in plan[:-1]) and all(size < cap * 2**20 + largest for size in plan)
    assert len(bucket_plan(model, 25)) == 1  # 2.2 MiB fits in one 25 MiB bucket
    assert len(bucket_plan(model, None)) == 2  # ... but the default caps its first bucket at 1 MiB
    frozen = DigitsMLP(hidden=512, depth=3).requires_grad_(False)
    assert bucket_plan(frozen, 25) == [], "no gradient, no bucket"


def test_powersgd_values():
    assert powersgd_values((512,), rank=4) == 512  # a bias is never compressed
    assert powersgd_values((256, 256), rank=2) == (256 + 256) * 2
    assert powersgd_values((4, 4), rank=2) == 16  # (4 + 4) * 2 * 2 >= 16: not worth it
    assert powersgd_values((10, 3, 3), rank=1) == 10 + 9  # viewed as 10 x 9
    assert powersgd_values((10, 512), rank=64) == 10 * 512  # rank capped at min(n, m), then not worth it


def test_hook_payload_bytes_closed_forms():
    shapes = [(256, 64), (256,), (10, 256), (10,)]
    numel = sum(math.prod(s) for s in shapes)
    assert hook_payload_bytes(shapes, "allreduce") == 4 * numel
    assert hook_payload_bytes(shapes, "fp16") == hook_payload_bytes(shapes, "bf16") == 2 * numel
    assert hook_payload_bytes(shapes, "powersgd", rank=1) == 4 * ((256 + 64) + 256 + (10 + 256) + 10)
    with pytest.raises(ValueError):
        hook_payload_bytes(shapes, "powersgd")
    with pytest.raises(ValueError):
        hook_payload_bytes(shapes, "int8")


def _count_in_ddp(caps, start_iter, bucket_bytes):
    """Worker: buckets counted per cap (by train_ddp.py's `bucket_bytes`, the comm hook notebook 02 counts with),
    and bytes sent per step by fp16 and PowerSGD hooks."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    buckets = {}
    for cap in caps:
        buckets[cap] = bucket_bytes(DDP(DigitsMLP(hidden=128, depth=3), bucket_cap_mb=cap), x, y)
    sent = {}
    for name in ("fp16", "powersgd"):
        model = DDP(DigitsMLP(hidden=128, depth=3))
        if name == "fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        else:
            state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=start_iter)
            model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        per_step = []
        with PayloadCounter() as wire:
            for _ in range(start_iter + 2):
                before = wire.bytes
                model.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                per_step.append(wire.bytes - before)
        sent[name] = per_step
    assert dist.all_reduce is not None and "counting" not in dist.all_reduce.__name__  # restored on exit
    dist.destroy_process_group()
    return buckets, sent


def test_counters_against_real_ddp():
    caps = [0.001, 0.05, 25]
    start_iter = 2
    # CPU ranks on any machine: a visible GPU would make torch's PowerSGD hook synchronize CUDA for a CPU bucket
    results = helpers.launch(_count_in_ddp, caps, start_iter, _train_ddp().bucket_bytes, world_size=2, timeout=120,
                             quiet=True, env=devices.CPU_ONLY_ENV)
    model = DigitsMLP(hidden=128, depth=3)
    shapes = [tuple(p.shape) for p in model.parameters()]
    for buckets, sent in results:
        for cap in caps:
            assert buckets[cap] == bucket_plan(model, cap)
        assert len(buckets[0.001]) > len(buckets[0.05]) > len(buckets[25]) == 1
        assert set(sent["fp16"]) == {hook_payload_bytes(shapes, "fp16")}
        plain, compressed = sent["powersgd"][:start_iter], sent["powersgd"][start_iter:]
        assert set(plain) == {hook_payload_bytes(shapes, "allreduce")}
        assert set(compressed) == {hook_payload_bytes(shapes, "powersgd", rank=2)}


def _powersgd_step_on_cpu(pretend_cuda: bool) -> tuple[list, str | None]:
    """One-rank gloo group, a CPU DDP model with PowerSGD from its first step; returns the torch.cuda.synchronize
    calls the hook made and the error the step raised (None if none). With pretend_cuda, the process believes a GPU
    is present (as a CPU rank on a GPU machine does) and synchronize records its argument, then raises as the real
    one does for a CPU device. Run in a launched worker, and the model freed before destroy_process_group: a DDP
    reducer that drops the last reference to a gloo group joins gloo's threads with the GIL held, and once hung
    this test's own process (the hazard described in docs/AUTHORING.md)."""
    import gc
    from unittest import mock

    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    calls, error = [], None

    def synchronize(device=None):
        calls.append(torch.device(device) if device is not None else None)
        if device is not None and torch.device(device).type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")

    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        model = DDP(DigitsMLP(hidden=32, depth=2))
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                            min_compression_rate=0.1)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
        try:
            with mock.patch.object(torch.cuda, "is_available", lambda: pretend_cuda), \
                    mock.patch.object(torch.cuda, "synchronize", synchronize):
                for _ in range(3):  # iterations 0-1 plain all-reduce, then PowerSGD
                    model.zero_grad()
                    torch.nn.functional.cross_entropy(model(x), y).backward()
        except RuntimeError as exc:  # the hook's ValueError, as the comm hook's future reports it
            error = str(exc)
        del model, state
        gc.collect()
    finally:
        dist.destroy_process_group()
    return [str(c) for c in calls], error


def test_powersgd_hook_synchronizes_cuda_for_a_cpu_bucket_when_a_gpu_is_visible():
    """The cause of the crash of notebook 02b's PowerSGD demo on CPU ranks of a GPU machine: torch's hook calls
    torch.cuda.synchronize(bucket device) whenever CUDA is available, whatever the bucket's device."""
    (calls, error), = helpers.launch(_powersgd_step_on_cpu, True, world_size=1, timeout=120)
    assert error is not None and "cuda device" in error and calls == ["cpu"]
    assert helpers.launch(_powersgd_step_on_cpu, False, world_size=1, timeout=120) == [([], None)], \
        "a process that sees no GPU makes no CUDA call"


def test_cpu_ranks_hide_the_gpus_only_when_ranks_outnumber_them():
    hidden = {"CUDA_VISIBLE_DEVICES": "", "COOKBOOK_BACKEND": "gloo"}
    assert devices.cpu_ranks_env(world_size=2, gpus=1) == hidden == devices.CPU_ONLY_ENV
    assert devices.cpu_ranks_env(world_size=4, gpus=2) == hidden
    assert devices.cpu_ranks_env(world_size=2, gpus=2) == {}  # a GPU per rank: NCCL, GPUs kept
    assert devices.cpu_ranks_env(world_size=2, gpus=0) == {}  # nothing to hide


def test_cpu_ranks_env_makes_a_one_rank_launch_on_a_gpu_machine_a_cpu_rank(monkeypatch):
    """Notebook 02b's weak-scaling launch at world size 1 on a one-GPU machine hides the GPU from its rank (every n on CPU ranks),
    but the launcher picks the backend from the kernel's view: NCCL for one rank. The helpers' rank_device() in
    step_times then chose cuda:0, which the rank cannot see (set_device fails). The env must set the backend too."""
    from helpers.launcher.api import plan

    monkeypatch.setattr(helpers.devices, "gpu_count", lambda: 1)  # the kernel's view of a one-GPU machine
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert plan(1, None, None, None, None)[2]["COOKBOOK_BACKEND"] == "nccl", "a rank with the GPU: NCCL"
    worker_env = plan(1, None, None, devices.cpu_ranks_env(world_size=4, gpus=1), None)[2]
    assert worker_env["CUDA_VISIBLE_DEVICES"] == ""
    for key in ("COOKBOOK_BACKEND", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(key, worker_env[key])
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert helpers.devices.default_backend() == "gloo" and helpers.devices.rank_device() == torch.device("cpu")


def _sees_cuda():
    from helpers.devices import rank_device

    return {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "available": torch.cuda.is_available(),
            "device": str(rank_device())}


def test_cpu_ranks_env_reaches_the_workers():
    for world_size in (1, 2):
        seen = helpers.launch(_sees_cuda, world_size=world_size, timeout=60, env=devices.CPU_ONLY_ENV)
        assert all(s == {"visible": "", "available": False, "device": "cpu"} for s in seen)


# ----------------------------------------------------------------------------------------------- timing workers


def test_ratio_interval_brackets_the_ratio_of_medians():
    a, b = [2.0, 2.1, 1.9, 2.05, 1.95], [1.0, 1.02, 0.98, 1.01, 0.99]
    low, high = measure_ddp.ratio_interval(a, b)
    assert low <= 2.0 <= high and high - low < 0.4
    assert measure_ddp.ratio_interval([1.0] * 5, [1.0] * 5) == (1.0, 1.0)


@pytest.mark.parametrize("grouped", [False, True])
def test_step_times_counts_buckets_and_keeps_variants_comparable(grouped):
    variants = {"step": {"ddp": {"bucket_cap_mb": 0.05}}, "no_sync": {"mode": "no_sync", "count_buckets": False},
                "delayed": {"mode": "delayed", "count_buckets": False}, "plain": {"ddp": None, "memory": True},
                "accum": {"accum": 2, "count_buckets": False}, "allreduce": {"mode": "allreduce", "params": False}}
    if grouped:  # each variant built, timed and freed on its own
        variants = {label: {**spec, "group": label} for label, spec in variants.items()}
    model_of = functools.partial(DigitsMLP, 64, 2)
    variants["allreduce"]["bucket_bytes"] = bucket_plan(model_of())
    script = _train_ddp()
    from helpers.measure.activations import LiveTensorBytes

    ranks = helpers.launch(script.run_distributed, script.step_times, model_of, 8, variants, 3,
                           memory_probe=LiveTensorBytes, world_size=2, timeout=120,
                           env=devices.cpu_ranks_env(2, devices.gpu_count()))
    for r in ranks:
        assert all(len(v["times"]) == 3 and min(v["times"]) > 0 for v in r.values())
        assert r["step"]["buckets"] == bucket_plan(model_of(), 0.05)
        assert r["plain"]["peak_bytes"] > 0
        assert "params" not in r["allreduce"], "params=False: no copy of the model sent back"
        # the same seed, batch and number of steps: overlapped and delayed all-reduce train the same parameters
        assert torch.allclose(r["step"]["params"], r["delayed"]["params"], rtol=1e-5, atol=1e-6)
    assert torch.equal(ranks[0]["delayed"]["params"], ranks[1]["delayed"]["params"])
    assert not torch.equal(ranks[0]["no_sync"]["params"], ranks[1]["no_sync"]["params"]), "no_sync: local steps"


def test_loader_throughput_reports_every_setting_and_repeat():
    settings = {"inline": {}, "one worker": {"num_workers": 1, "persistent_workers": True}}
    rates = helpers.launch(_train_ddp().loader_throughput, settings, 32, 3, 2, world_size=1, timeout=120)[0]
    assert set(rates) == set(settings) and all(len(r) == 2 and min(r) > 0 for r in rates.values())


def test_scaling_variants_time_the_step_compute_and_buckets_alone_and_the_plain_step_at_world_size_one():
    """The variants of notebook 02b's weak scaling (its cell launches them and computes the rows): the all-reduce
    variant reduces the buckets it is given; at world size 1 the plain module runs beside DDP's step."""
    script, model_of = _train_ddp(), functools.partial(DigitsMLP, 32, 2)
    modes = measure_ddp.scaling_variants(bucket_plan(model_of()))
    assert set(modes) == {"step", "no_sync", "allreduce"} and modes["allreduce"]["bucket_bytes"] == bucket_plan(model_of())
    ranks = helpers.launch(script.run_distributed, script.step_times, model_of, 8,
                           {**modes, "plain": {"ddp": None, "params": False}}, 2, world_size=1, timeout=120,
                           env=devices.cpu_ranks_env(1, 1), threads=1)
    assert set(ranks[0]) == {"step", "no_sync", "allreduce", "plain"}
    assert all(len(v["times"]) == 2 and min(v["times"]) > 0 for v in ranks[0].values())
    assert "params" in ranks[0]["step"] and "params" not in ranks[0]["no_sync"], "only the DDP step's come back"


def test_expected_payload_counts_powersgd_warm_up_steps_as_plain_fp32():
    shapes = [(64, 32), (64,)]
    plain = 4 * (64 * 32 + 64)
    assert measure_ddp.expected_payload(shapes, "fp16", None, steps=3) == {"bytes_per_step": plain // 2,
                                                                           "expected_total": 3 * plain // 2}
    compressed = 4 * ((64 + 32) * 1 + 64)
    got = measure_ddp.expected_payload(shapes, "powersgd", 1, steps=5, start_powersgd_iter=2)
    assert got == {"bytes_per_step": compressed, "expected_total": 2 * plain + 3 * compressed}
    one_step = measure_ddp.expected_payload(shapes, "powersgd", 1, steps=1, start_powersgd_iter=2)
    assert one_step["expected_total"] == plain


@pytest.mark.parametrize("cap", [0.05, 25])
def test_traced_step_makes_one_all_reduce_per_planned_bucket_and_measures_its_overlap(tmp_path, cap):
    model_of = functools.partial(DigitsMLP, 64, 3)
    script = _train_ddp()
    ranks = helpers.launch(script.run_distributed, script.traced_step, model_of, 8, {"bucket_cap_mb": cap},
                           str(tmp_path), world_size=2, timeout=120, env=devices.CPU_ONLY_ENV)
    for rank, r in enumerate(ranks):
        assert r["allreduces"] == len(bucket_plan(model_of(), cap)) and r["device"] == "cpu"
        assert r["trace"] == str(tmp_path / f"ddp_step_rank{rank}.json") and os.path.exists(r["trace"])
        m = overlap_of_trace(r["trace"], r["device"])
        assert m["comm_us"] > 0 and m["compute_us"] > 0 and 0 <= m["overlap_us"] <= min(m["comm_us"], m["compute_us"])
        assert m["exposed_comm_us"] == pytest.approx(m["comm_us"] - m["overlap_us"])


def test_demo_ranks_decides_where_notebooks_02_and_02b_run(capsys):
    on_gpus = measure_ddp.demo_ranks(2, {"gpus": 2, "cores": 16}, 64, "gpu")
    assert on_gpus == (True, {}, "2 GPU ranks, NCCL")
    one_gpu = measure_ddp.demo_ranks(2, {"gpus": 1, "cores": 16}, 64, "cpu")  # more ranks than GPUs: CPU, GPU hidden
    assert one_gpu.gpu_ranks is False and one_gpu.env == devices.CPU_ONLY_ENV
    assert one_gpu.where.startswith("2 CPU ranks, gloo (this machine has 1 GPU")
    crowded = measure_ddp.demo_ranks(4, {"gpus": 0, "cores": 2}, 64, "smoke")
    assert crowded.env == {} and "WARNING: 4 CPU ranks on 2 cores" in capsys.readouterr().out
    for world_size, batch in ((1, 64), (3, 64)):  # one rank compares nothing; 64 does not split over 3
        with pytest.raises(ValueError, match="split GLOBAL_BATCH"):
            measure_ddp.demo_ranks(world_size, {"gpus": 0, "cores": 2}, batch, "cpu")
    assert set(measure_ddp.NOTEBOOK_SIZES) == {"smoke", "cpu", "gpu"}


def test_gpu_trace_overlap_takes_nccl_kernels_as_communication_and_other_kernels_as_compute():
    """traced_step's GPU branch on a synthetic kineto trace: device kernels only ("cat": "kernel"); the host's
    op and annotation spans (which only say when work was queued) are left out."""
    from helpers.measure.trace_overlap import overlap

    def span(name, cat, ts, dur):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": 7}

    events = [span("sm90_xmma_gemm_f32f32_f32f32_f32_tn_n", "kernel", 0, 100),
              span("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "kernel", 60, 80),
              span("nccl:all_reduce", "cpu_op", 0, 500), span("nccl:all_reduce", "gpu_user_annotation", 60, 80),
              span("aten::addmm", "cpu_op", 0, 500), span("Memcpy DtoD (Device -> Device)", "gpu_memcpy", 150, 10)]
    got = overlap({"traceEvents": events}, comm=is_gpu_comm, compute=is_gpu_compute)
    assert (got["comm_us"], got["compute_us"], got["overlap_us"], got["exposed_comm_us"]) == (80, 100, 40, 40)
