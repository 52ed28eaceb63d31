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


def _pipeline_splits(pp, chunks, n_layers):
    """The recipe's pipeline_split of its GPT (meta device) on each rank of a pp-rank pipeline with `chunks` stages
    per rank, each rank played in turn through torch's fake process group: {(rank, chunk): parameter names}, or
    the ValueError's message."""
    import sys

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    sys.path.insert(0, str(SCRIPTS / "train"))
    from model import GPT, GPTConfig
    from parallelize import build_mesh, pipeline_split

    cfg = GPTConfig(vocab_size=64, dim=16, n_layers=n_layers, n_heads=2, max_seq_len=8)
    kept = {}
    for rank in range(pp):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=pp)
        try:
            pp_mesh = build_mesh(pp, 1, 1, 1, pp, "cpu")["pp"]
            for chunk in range(chunks):
                with torch.device("meta"):
                    model = GPT(cfg)
                try:
                    stage = pipeline_split(model, pp_mesh, chunk, chunks)
                except ValueError as e:
                    return str(e)
                kept[(rank, chunk)] = sorted(n for n, _ in stage.named_parameters())
        finally:
            dist.destroy_process_group()
    with torch.device("meta"):
        kept["whole"] = sorted(n for n, _ in GPT(cfg).named_parameters())
    return kept


def test_a_pipeline_whose_layers_do_not_split_into_equal_stages_is_refused():
    """8 stages of 4 layers: before, every stage kept 0 blocks and trained without them."""
    refused = launch(_pipeline_splits, 8, 1, 4, world_size=1, timeout=120)[0]
    assert refused == "4 layers do not split into 8 equal stages"


@pytest.mark.parametrize("pp, chunks", [(2, 1), (8, 1), (4, 2)])
def test_the_stages_tile_the_model_under_its_own_names(pp, chunks):
    """Every parameter in exactly one stage, under the whole model's name; the embeddings on stage 0, the final
    norm and output on the last; stage s holds the s-th run of consecutive blocks (rank r's chunk c is stage
    r + c·pp: the interleaved schedule's stages on a rank are not neighbours)."""
    kept = launch(_pipeline_splits, pp, chunks, 16, world_size=1, timeout=120)[0]
    whole = kept.pop("whole")
    assert sorted(n for names in kept.values() for n in names) == whole
    stages, per = pp * chunks, 16 // (pp * chunks)
    for (rank, chunk), names in kept.items():
        s = rank + chunk * pp
        assert {int(n.split(".")[1]) for n in names if n.startswith("layers.")} == set(range(s * per, (s + 1) * per))
        assert ("tok_embeddings.weight" in names) == (s == 0) and ("output.weight" in names) == (s == stages - 1)
