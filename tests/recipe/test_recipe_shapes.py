"""The recipes' splits at sizes a CPU machine cannot launch. The recipe's tensor-parallel plan (scripts/train/,
`apply_tp` on `build_mesh`'s tp dimension) at the degrees of notebook 07's torchrun lines (8 GPUs in one node): run
on one process that plays rank 0 of tp through torch's fake process group (collectives return without talking to
anyone), which is enough to check every shape the plan makes. Found by reading, before any GPU ran it: with the
former train_tp.py's 4 heads, `--tp 8` (notebook 07's two-node torchrun line) gave each rank half a head and the
attention's `view` failed; the recipe's `check_layout` now refuses such a layout before anything starts."""
from __future__ import annotations

import pytest

from helpers.launcher import launch
from helpers.paths import SCRIPTS


def _forward_at_tp(tp, n_heads, n_kv_heads):
    """The recipe's GPU-sized Llama (one block) built as train.py builds it at --tp `tp`: logits' global and local
    shapes."""
    import sys

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    sys.path.insert(0, str(SCRIPTS / "train"))
    from config import preset
    from model import Llama
    from parallelize import build_mesh
    from tp import apply_tp
    from job import DEVICE_DEFAULTS

    cfg = preset(DEVICE_DEFAULTS["gpu"]["model"], vocab_size=256, n_layers=1, n_heads=n_heads, n_kv_heads=n_kv_heads)
    seq_len = cfg.max_seq_len
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        mesh = build_mesh(tp, 1, 1, tp, 1, "cpu", cfg, seq_len)
        with torch.device("meta"):
            model = Llama(cfg)
        apply_tp(model, mesh["tp"])
        model.to_empty(device="cpu")
        model.init_weights(0)
        with torch.no_grad():
            logits = model(torch.zeros(1, seq_len, dtype=torch.long))
        return tuple(logits.shape), tuple(logits.to_local().shape), seq_len, cfg.vocab_size
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tp, n_heads, n_kv_heads", [(2, 12, 4), (4, 12, 4), (8, 16, 8)])
def test_the_notebooks_tp_lines_split_whole_heads_over_eight_gpus(tp, n_heads, n_kv_heads):
    """--tp 2 and 4 with the GPU defaults' 12 query and 4 key/value heads, --tp 8 with --n-heads 16 --n-kv-heads 8
    (notebook 07's lines)."""
    shape, local, seq_len, vocab = launch(_forward_at_tp, tp, n_heads, n_kv_heads, world_size=1, timeout=300)[0]
    assert shape == (1, seq_len, vocab) and local == (1, seq_len, vocab // tp), "logits sharded over the vocabulary"


def test_heads_that_tp_cannot_split_are_refused_before_anything_starts(monkeypatch, capsys):
    """The GPU defaults' 12 query and 4 key/value heads at --tp 8: one line and exit status 2 from train.py's
    flags, no process group."""
    import sys

    sys.path.insert(0, str(SCRIPTS / "train"))
    import train

    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(SystemExit) as refused:
        train.parse_args(["--tp", "8", "--model", "small"])
    assert refused.value.code == 2 and "tp 8 must divide the 12 query and 4 key/value heads" in capsys.readouterr().err


def _pipeline_splits(pp, chunks, n_layers, style="loop"):
    """The recipe's pipeline_split of its Llama (meta device) on each rank of a pp-rank pipeline with `chunks` stages
    per rank, each rank played in turn through torch's fake process group: {(rank, chunk): parameter names}, or
    the ValueError's message."""
    import sys

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    sys.path.insert(0, str(SCRIPTS / "train"))
    from config import LlamaArgs
    from model import Llama
    from parallelize import build_mesh
    from pipeline import pipeline_split

    cfg = LlamaArgs(vocab_size=64, dim=16, n_layers=n_layers, n_heads=2, max_seq_len=8)
    kept = {}
    for rank in range(pp):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=pp)
        try:
            pp_mesh = build_mesh(pp, 1, 1, 1, pp, "cpu")["pp"]
            for chunk in range(chunks):
                with torch.device("meta"):
                    model = Llama(cfg)
                try:
                    stage = pipeline_split(model, pp_mesh, chunk, chunks, style)
                except ValueError as e:
                    return str(e)
                kept[(rank, chunk)] = sorted(n for n, _ in stage.named_parameters())
        finally:
            dist.destroy_process_group()
    with torch.device("meta"):
        kept["whole"] = sorted(n for n, _ in Llama(cfg).named_parameters())
    return kept


def test_a_pipeline_with_more_stages_than_layers_is_refused():
    """8 stages of 4 layers: before any check, every stage kept 0 blocks and trained without them."""
    refused = launch(_pipeline_splits, 8, 1, 4, world_size=1, timeout=300)[0]
    assert refused == "4 layers do not fill 8 stages"


@pytest.mark.parametrize("pp, chunks, n_layers, style", [(2, 1, 16, "loop"), (8, 1, 16, "loop"), (4, 2, 16, "loop"),
                                                          (8, 1, 126, "loop"), (4, 2, 16, "v")])
def test_the_stages_tile_the_model_under_its_own_names(pp, chunks, n_layers, style):
    """Every parameter in exactly one stage, under the whole model's name; the embedding on stage 0, the final norm
    and output on the last; stage s holds the s-th run of consecutive blocks (rank r's chunk c is stage r + c·pp:
    the interleaved schedule's stages on a rank are not neighbours), split as torchtitan splits them: the embedding
    and the output count as a block each, and the first stages take one more where they do not divide (126 layers
    over 8 stages: 15, 16 x 6, 15). In a V (the ZBV schedule) rank r's second chunk is stage 2p - 1 - r instead."""
    kept = launch(_pipeline_splits, pp, chunks, n_layers, style, world_size=1, timeout=300)[0]
    whole = kept.pop("whole")
    assert sorted(n for names in kept.values() for n in names) == whole
    stages = pp * chunks
    index = {(r, c): (2 * pp - 1 - r if style == "v" and c == 1 else r + c * pp) for r, c in kept}
    blocks = {index[key]: sorted({int(n.split(".")[1]) for n in names if n.startswith("layers.")})
              for key, names in kept.items()}
    sizes = [len(blocks[s]) + (s == 0) + (s == stages - 1) for s in range(stages)]     # embedding, output: one each
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True), sizes
    assert [b for s in range(stages) for b in blocks[s]] == list(range(n_layers)), "consecutive runs, in order"
    for key, names in kept.items():
        s = index[key]
        assert ("tok_embeddings.weight" in names) == (s == 0) and ("output.weight" in names) == (s == stages - 1)
