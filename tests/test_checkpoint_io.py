"""Unit tests of helpers.measure.disk."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, init_device_mesh

from helpers.measure import disk as checkpoint_io


def test_disk_rates_are_positive_and_leave_nothing_behind(tmp_path):
    writes = checkpoint_io.disk_write_rate(tmp_path, 1 << 20, repeats=2)
    reads = checkpoint_io.disk_read_rate(tmp_path, 1 << 20, repeats=2)
    assert len(writes) == 2 and all(r > 0 for r in writes + reads)
    assert list(tmp_path.iterdir()) == []


def test_directory_bytes(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 100)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(b"y" * 23)
    assert checkpoint_io.directory_bytes(tmp_path) == 123


def test_state_bytes_counts_tensors_in_nested_state():
    state = {"model": {"w": torch.zeros(10), "b": torch.zeros(3, dtype=torch.float16)},
             "optim": [torch.zeros(2, dtype=torch.float64)], "step": 7, "name": "x"}
    assert checkpoint_io.state_bytes(state) == 40 + 6 + 16


def test_state_bytes_counts_the_local_shard_of_a_dtensor():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        d = DTensor.from_local(torch.zeros(5), mesh, [Shard(0)])
        assert checkpoint_io.state_bytes({"p": d}) == 20
    finally:
        dist.destroy_process_group()
