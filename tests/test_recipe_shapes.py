"""The recipes' splits at sizes a CPU machine cannot launch. scripts/train_tp.py's plan at tensor-parallel degrees a CPU machine cannot launch (8 GPUs in one node): run on
one process that plays rank 0 of 8 through torch's fake process group (collectives return without talking to
anyone), which is enough to check every shape the plan makes. Found by reading, before any GPU ran it: with the
script's former 4 heads, `--tp 8` (notebook 07's two-node torchrun line) gave each rank half a head and the
attention's `view` failed."""
from __future__ import annotations

import pytest

from helpers.launcher import launch
from helpers.paths import SCRIPTS


def _forward_at_tp(tp, argv):
    import sys

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    sys.path.insert(0, str(SCRIPTS))
    import train_tp

    args = train_tp.parse_args(argv)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        model = train_tp.GPT(128, args.d_model, 1, args.heads, args.seq_len)
        model = train_tp.apply_tp(model, mesh)
        logits = model(torch.zeros(2, args.seq_len, dtype=torch.long))
        return tuple(logits.shape), tuple(logits.to_local().shape)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_the_scripts_default_heads_split_whole_over_eight_gpus(tp):
    shape, local = launch(_forward_at_tp, tp, ["--tp", str(tp)], world_size=1, timeout=120)[0]
    assert shape == (2, 64, 128) and local == (2, 64, 128 // tp), "logits sharded over the vocabulary"


def test_heads_that_tp_cannot_split_are_refused_before_anything_starts():
    import sys

    sys.path.insert(0, str(SCRIPTS))
    import train_tp

    with pytest.raises(SystemExit):
        train_tp.parse_args(["--tp", "8", "--heads", "4"])


def test_a_pipeline_whose_layers_do_not_split_into_equal_stages_is_refused():
    """8 ranks with the script's default 4 layers: before, every stage kept 0 blocks and trained without them."""
    import sys

    sys.path.insert(0, str(SCRIPTS))
    import train_pipeline

    cfg = train_pipeline.Config(vocab_size=64, d_model=16, n_layers=4, n_heads=2)
    with pytest.raises(ValueError, match="do not split into 8 equal stages"):
        train_pipeline.stage_module(train_pipeline.GPT(cfg), 0, 8)
    kept = train_pipeline.stage_module(train_pipeline.GPT(cfg), 1, 2)
    assert list(kept.blocks) == ["2", "3"] and kept.tok is None and kept.head is not None
