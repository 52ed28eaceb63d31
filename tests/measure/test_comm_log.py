"""CollectiveLog: kinds, dtypes, sizes and group sizes of the collectives a step issues."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers.measure.collectives import single_tensor_collectives
from helpers.measure.comm_log import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, Collective, CollectiveLog


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ring_bytes_follow_the_busbw_factors():
    assert Collective(ALL_REDUCE, 100, 4, 4).ring_bytes_sent == pytest.approx(400 * 2 * 3 / 4)
    assert Collective(ALL_GATHER, 100, 2, 2).ring_bytes_sent == pytest.approx(200 * 1 / 2)
    assert Collective("broadcast", 100, 4, 4).ring_bytes_sent == 400
    assert Collective(REDUCE_SCATTER, 8, 4, 1).ring_bytes_sent == 0
    assert Collective("broadcast", 8, 4, 1).ring_bytes_sent == 0


@pytest.mark.parametrize("names", ["this torch's", "before 2.13"])
def test_records_op_dtype_and_bytes(one_rank_group, names, monkeypatch):
    if names == "before 2.13":  # torch 2.11 has only all_gather_into_tensor / reduce_scatter_tensor
        monkeypatch.delattr(dist, "all_gather_single", raising=False)
        monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)
    all_gather_single, reduce_scatter_single = single_tensor_collectives()
    shard = torch.ones(10, dtype=torch.bfloat16)
    full = torch.empty(10, dtype=torch.bfloat16)
    grads = torch.ones(8)
    with CollectiveLog() as log:
        all_gather_single(full, shard)
        dist.all_reduce(grads)
        reduce_scatter_single(torch.empty(8), torch.ones(8))
    assert [c.op for c in log.calls] == ["_allgather_base_", "allreduce_", "_reduce_scatter_base_"]
    assert [c.kind for c in log.calls] == [ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER]
    gather, reduce, scatter = log.calls
    assert gather.dtype == "bfloat16" and gather.bytes == 20 and gather.group_size == 1
    assert reduce.dtype == "float32" and reduce.bytes == 32
    assert scatter.dtype == "float32" and scatter.bytes == 32
    assert log.summary()[ALL_GATHER] == {"calls": 1, "numel": 10, "bytes": 20, "group_sizes": [1],
                                         "dtypes": ["bfloat16"]}


def test_ignores_ordinary_ops(one_rank_group):
    with CollectiveLog() as log:
        torch.ones(4) + 1
    assert log.calls == []


def _collectives_worker():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    log = CollectiveLog()
    with log:
        t = torch.ones(10)
        dist.all_reduce(t)
        all_gather_single, reduce_scatter_single = single_tensor_collectives()
        out = torch.empty(6 * world, dtype=torch.bfloat16)
        all_gather_single(out, torch.ones(6, dtype=torch.bfloat16))
        rs = torch.empty(3)
        reduce_scatter_single(rs, torch.ones(3 * world))
        mesh = init_device_mesh("cpu", (world,))
        d = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
        d.redistribute(mesh, [Replicate()])
    dist.destroy_process_group()
    return log.summary(), log.counts(), log.ring_bytes_sent()


def test_log_records_c10d_and_dtensor_collectives():
    import helpers

    summary, counts, ring = helpers.launch(_collectives_worker, world_size=2, timeout=120, quiet=True)[0]
    assert summary[ALL_REDUCE] == {"calls": 1, "numel": 10, "bytes": 40, "group_sizes": [2], "dtypes": ["float32"]}
    # one plain bf16 all-gather of 12 elements (its output), one fp32 from the DTensor redistribute of the 4 x 2 tensor
    assert summary[ALL_GATHER] == {"calls": 2, "numel": 12 + 8, "bytes": 12 * 2 + 8 * 4, "group_sizes": [2],
                                   "dtypes": ["bfloat16", "float32"]}
    assert summary[REDUCE_SCATTER] == {"calls": 1, "numel": 6, "bytes": 24, "group_sizes": [2],
                                       "dtypes": ["float32"]}
    assert counts == {ALL_REDUCE: 1, ALL_GATHER: 2, REDUCE_SCATTER: 1}
    assert ring == pytest.approx(40 * 2 * 0.5 + (12 * 2 + 8 * 4) * 0.5 + 24 * 0.5)


def _fsdp_step_collectives():
    import warnings

    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from helpers.measure.comm_log import collectives_of_step

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        x = torch.randn(3, 4)
        return collectives_of_step(model, lambda m: m(x).sum().backward(), warmup=1)
    finally:
        dist.destroy_process_group()


def test_collectives_of_step_counts_fsdp_groups_both_ways():
    import helpers

    for r in helpers.launch(_fsdp_step_collectives, world_size=2, timeout=120, quiet=True):
        # two groups, the inner one resharded after forward, the root not: 3 all-gathers, 2 reduce-scatters
        assert r["log"]["all_gather"]["calls"] == 3 and r["log"]["reduce_scatter"]["calls"] == 2
        assert sum(n for op, n in r["counts"].items() if "allgather" in op) == 3, "CommDebugMode agrees"
        assert r["ring_bytes"]["all_gather"] == r["log"]["all_gather"]["bytes"] / 2, "(N-1)/N of each buffer"
        assert sum(r["forward_gathers"].values()) >= 1
