"""Unit tests of helpers.comm_bytes on a one-rank gloo group (in process, no launcher needed)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers.comm_bytes import CollectiveLog


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_records_op_dtype_and_bytes(one_rank_group):
    shard = torch.ones(10, dtype=torch.bfloat16)
    full = torch.empty(10, dtype=torch.bfloat16)
    grads = torch.ones(8)
    with CollectiveLog() as log:
        dist.all_gather_single(full, shard)  # all_gather_into_tensor before torch 2.13
        dist.all_reduce(grads)
        dist.reduce_scatter_single(torch.empty(8), torch.ones(8))  # reduce_scatter_tensor before 2.13
    ops = [c.op for c in log.calls]
    assert ops == ["_allgather_base_", "allreduce_", "_reduce_scatter_base_"]
    gather, reduce, scatter = log.calls
    assert gather.dtype == torch.bfloat16 and gather.in_bytes == 20 and gather.out_bytes == 20
    assert reduce.dtype == torch.float32 and reduce.in_bytes == 32
    assert scatter.in_bytes == 32 and scatter.out_bytes == 32
    table = log.summary()
    assert table[("_allgather_base_", "bfloat16")] == {"calls": 1, "in_bytes": 20, "out_bytes": 20}


def test_ignores_ordinary_ops(one_rank_group):
    with CollectiveLog() as log:
        torch.ones(4) + 1
    assert log.calls == []
