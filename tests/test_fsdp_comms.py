"""CollectiveLog: kinds, sizes and group sizes of the collectives a step issues."""
from __future__ import annotations

import pytest

from helpers.fsdp_comms import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, Collective, CollectiveLog


def test_ring_bytes_follow_the_busbw_factors():
    assert Collective(ALL_REDUCE, 100, 4, 4).ring_bytes_sent == pytest.approx(400 * 2 * 3 / 4)
    assert Collective(ALL_GATHER, 100, 2, 2).ring_bytes_sent == pytest.approx(200 * 1 / 2)
    assert Collective(REDUCE_SCATTER, 8, 4, 1).ring_bytes_sent == 0


def _collectives_worker():
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    log = CollectiveLog()
    with log:
        t = torch.ones(10)
        dist.all_reduce(t)
        out = torch.empty(6 * world)
        dist.all_gather_into_tensor(out, torch.ones(6))
        rs = torch.empty(3)
        dist.reduce_scatter_tensor(rs, torch.ones(3 * world))
        mesh = init_device_mesh("cpu", (world,))
        d = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
        d.redistribute(mesh, [Replicate()])
    dist.destroy_process_group()
    return log.summary(), log.counts(), log.ring_bytes_sent()


def test_log_records_c10d_and_dtensor_collectives():
    import helpers

    summary, counts, ring = helpers.launch(_collectives_worker, world_size=2, timeout=120, quiet=True)[0]
    assert summary[ALL_REDUCE] == {"calls": 1, "numel": 10, "bytes": 40, "group_sizes": [2]}
    # one plain all-gather of 12 elements, one from the DTensor redistribute of the 4 x 2 tensor
    assert summary[ALL_GATHER]["calls"] == 2 and summary[ALL_GATHER]["numel"] == 12 + 8
    assert summary[REDUCE_SCATTER] == {"calls": 1, "numel": 6, "bytes": 24, "group_sizes": [2]}
    assert counts == {ALL_REDUCE: 1, ALL_GATHER: 2, REDUCE_SCATTER: 1}
    assert ring == pytest.approx(40 * 2 * 0.5 + (12 + 8) * 4 * 0.5 + 24 * 0.5)
