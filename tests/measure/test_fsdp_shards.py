"""FSDP2's per-rank arithmetic: torch.chunk's split, the padding, and agreement with a real fully_shard."""
from __future__ import annotations

import math
import sys
import warnings

import pytest
import torch

from helpers.measure.fsdp import fsdp_state_bytes, padded_numel, padded_rows, padding_numel, shard_numel, shard_rows

from helpers.paths import SCRIPTS

if str(SCRIPTS / "train") not in sys.path:  # the recipe's Llama (scripts/train/model.py), imported as notebooks do
    sys.path.insert(0, str(SCRIPTS / "train"))

SHAPES = [(103, 128), (64, 128), (384, 128), (384,), (128,), (5, 3), (1, 7)]


@pytest.mark.parametrize("dim0", [1, 2, 3, 5, 7, 64, 103, 384])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_shard_rows_follow_torch_chunk(dim0, world_size):
    chunks = [c.shape[0] for c in torch.arange(dim0).chunk(world_size)]
    chunks += [0] * (world_size - len(chunks))  # chunk returns fewer pieces; those ranks own nothing
    assert [shard_rows(dim0, world_size, r) for r in range(world_size)] == chunks
    assert padded_rows(dim0, world_size) == max(chunks)
    assert dim0 <= world_size * padded_rows(dim0, world_size) < dim0 + world_size


def test_held_bytes_add_up_to_zeros_16_psi_and_allocated_is_padded():
    psi = sum(math.prod(s) for s in SHAPES)
    for n in (1, 2, 3, 4):
        per_rank = [fsdp_state_bytes(SHAPES, n, r) for r in range(n)]
        assert sum(sum(p["held"].values()) for p in per_rank) == 16 * psi
        assert sum(shard_numel(SHAPES, n, r) for r in range(n)) == psi
        for p in per_rank:
            assert p["allocated"]["parameters"] == p["allocated"]["gradients"] == 4 * padded_numel(SHAPES, n)
            assert n * p["allocated"]["parameters"] == 4 * (psi + padding_numel(SHAPES, n))
            assert p["allocated"]["optimizer"] == p["held"]["optimizer"]
    assert padding_numel(SHAPES, 1) == 0
    assert padding_numel([(103, 128)], 2) == 128 and padding_numel([(5, 3)], 4) == 9  # 4 x 2 rows - 5


def test_mixed_precision_byte_widths_are_honoured():
    b = fsdp_state_bytes([(10, 2)], 2, 0, param_bytes=2, grad_bytes=2, optimizer_bytes=12)
    assert b["held"] == {"parameters": 20, "gradients": 20, "optimizer": 120}


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        shard_rows(10, 2, 2)
    with pytest.raises(ValueError):
        padded_rows(10, 0)


def _fsdp_bytes_worker(vocab):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from helpers.measure.memory import allocated_state_bytes, model_state_bytes
    import torch.nn.functional as F
    from model import Llama, LlamaArgs

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Llama(LlamaArgs(vocab_size=vocab, dim=32, n_layers=1, n_heads=2, max_seq_len=8))
    shapes = [tuple(p.shape) for p in model.parameters()]
    for block in model.layers.values():
        fully_shard(block, mesh=init_device_mesh("cpu", (world,)))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.Adam(model.parameters())
    x = torch.randint(0, vocab, (2, 8))
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    opt.step()
    out = {"shapes": shapes, "held": model_state_bytes(model, opt), "allocated": allocated_state_bytes(model, opt)}
    dist.destroy_process_group()
    return out


def test_formula_matches_a_real_fully_shard():
    import helpers

    results = helpers.launch(_fsdp_bytes_worker, 13, world_size=2, timeout=600, quiet=True)  # 33 s here, loaded
    for rank, r in enumerate(results):
        expected = fsdp_state_bytes(r["shapes"], 2, rank)
        assert r["held"] == expected["held"]
        assert r["allocated"] == expected["allocated"]
    assert results[0]["held"] != results[1]["held"], "13 rows split 7 / 6: the ranks differ"


def test_gathered_numel_pads_every_parameter_and_splits_root_from_blocks():
    from torch import nn

    from helpers.measure.fsdp import gathered_numel

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleDict({str(i): nn.Linear(3, 5) for i in range(2)})  # weight 5x3, bias 5
            self.head = nn.Linear(5, 7, bias=False)                            # 7x5

    with torch.device("meta"):
        model = Tiny()
    # world 2: dim 0 padded to even rows: 5 -> 6 (weight 6x3 = 18, bias 6), 7 -> 8 (8x5 = 40)
    assert gathered_numel(model, 2) == (40, 2 * (18 + 6))
    assert gathered_numel(model, 1) == (35, 2 * (15 + 5))
    assert gathered_numel(model, 2, blocks=[model.head]) == (2 * (18 + 6), 40), "blocks named by the caller"


def test_gathered_numel_reads_the_recipes_layers_as_the_blocks():
    from config import LlamaArgs
    from model import Llama

    from helpers.measure.fsdp import gathered_numel

    with torch.device("meta"):
        model = Llama(LlamaArgs(vocab_size=11, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, max_seq_len=5, multiple_of=8))
    root, blocks = gathered_numel(model, 3)
    # root: tok_embeddings 11x8 (12 rows padded), norm 8 (9), output 11x8 (12); the rotary tables are buffers
    assert root == (12 + 12) * 8 + 9
    # each block: wq, wo 8x8 (9 rows); wk, wv 4x8 (one key/value head of 4: 6 rows); w1, w3 24x8 (24: 2/3 of 4 x 8,
    # rounded up to a multiple of 8); w2 8x24 (9); two norms 8 (9)
    assert blocks == 2 * (2 * 9 * 8 + 2 * 6 * 8 + 2 * 24 * 8 + 9 * 24 + 2 * 9)
