"""Supervised fine-tuning in the recipe: conversations packed into one row (scripts/train/model.py's `positions`
and block-causal mask, notebook 03) give each conversation's own loss and gradients, in one process and under
tensor parallel."""
from __future__ import annotations

import sys

import pytest
import torch

from helpers.launcher import launch
from helpers.paths import SCRIPTS

sys.path.insert(0, str(SCRIPTS / "train"))
from config import LlamaArgs  # noqa: E402
from model import IGNORE_INDEX, Llama, cross_entropy  # noqa: E402

CFG = LlamaArgs(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=48, multiple_of=32)
LENGTHS = (13, 9, 20)          # three conversations, then 6 tokens of padding: a row of 48


def packed_row(lengths=LENGTHS, seq=CFG.max_seq_len, seed=0):
    """Conversations of `lengths` tokens packed into one row of `seq`, as the SFT loader makes them: (tokens,
    targets, positions, each conversation's (tokens, targets)). A conversation's targets are its next tokens where
    they are answers (here a random two thirds), -100 elsewhere and at its last token; padding has none."""
    g = torch.Generator().manual_seed(seed)
    alone, pieces = [], []
    for n in lengths:
        tokens = torch.randint(0, CFG.vocab_size, (n,), generator=g)
        targets = torch.cat([tokens[1:], torch.tensor([IGNORE_INDEX])])
        targets[torch.rand(n, generator=g) < 1 / 3] = IGNORE_INDEX
        alone.append((tokens, targets))
        pieces.append((tokens, targets, torch.arange(n)))
    pad = seq - sum(lengths)
    pieces.append((torch.zeros(pad, dtype=torch.long), torch.full((pad,), IGNORE_INDEX), torch.arange(pad)))
    tokens, targets, positions = (torch.cat(parts)[None] for parts in zip(*pieces))
    return tokens, targets, positions, alone


def _model(seed=7):
    model = Llama(CFG)
    model.init_weights(seed)
    with torch.no_grad():           # sharper attention than at initialisation: where a leak across rows would show
        for name, p in model.named_parameters():
            p.mul_(10 if name.endswith(("wq.weight", "wk.weight")) else 1)
    return model


def _loss_and_grads(model, loss):
    model.zero_grad()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_packed_row_gives_each_conversations_own_loss_and_gradients():
    """float32. Packed: the mean over the row's targets. Alone: each conversation's summed loss, added, divided by
    the same count of targets. Tolerance 1e-5 relative (1e-7 absolute): the same sums, the masked scores exactly zero,
    in another order. Without the mask, or with positions running on across the row, they differ by far more."""
    model = _model()
    tokens, targets, positions, alone = packed_row()
    count = int((targets != IGNORE_INDEX).sum())
    packed = _loss_and_grads(model, cross_entropy(model(tokens, positions=positions), targets))
    total = sum(cross_entropy(model(t[None]), y[None], reduction="sum") for t, y in alone)
    one_by_one = _loss_and_grads(model, total / count)
    assert abs(packed[0] - one_by_one[0]) <= 1e-5 * one_by_one[0]
    for name, grad in one_by_one[1].items():
        torch.testing.assert_close(packed[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)
    running = torch.arange(tokens.shape[1])[None]          # positions that do not restart: one long sequence
    for wrong in (cross_entropy(model(tokens), targets), cross_entropy(model(tokens, positions=running), targets)):
        assert abs(wrong.item() - one_by_one[0]) > 1e-3, "attention across conversations changes the loss"


def test_a_mask_that_restarts_is_block_causal_and_the_cache_path_is_unchanged():
    from model import block_causal_mask

    mask = block_causal_mask(torch.tensor([[0, 1, 2, 0, 1, 0]]))[0, 0]
    expected = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                             [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)
    model = _model().eval()
    tokens = packed_row()[0][:, :20]
    with torch.no_grad():
        whole = model(tokens, positions=torch.arange(20)[None])      # one sequence from 0: the plain causal model
        assert torch.allclose(whole, model(tokens), atol=1e-6)


def _tensor_parallel_packed(lengths):
    """The packed row through the model under tensor parallel (2 ranks, sequence parallel, loss_parallel) against
    one process: loss and the gradients (full tensors)."""
    import sys

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    sys.path.insert(0, str(SCRIPTS / "train"))
    from model import cross_entropy
    from tp import apply_tp

    dist.init_process_group("gloo")
    try:
        tokens, targets, positions, _ = packed_row(lengths)
        reference, model = _model(), _model()
        ref_loss, ref_grads = _loss_and_grads(reference, cross_entropy(reference(tokens, positions=positions), targets))
        apply_tp(model, init_device_mesh("cpu", (dist.get_world_size(),)), loss_parallel=True)
        with loss_parallel():
            loss = cross_entropy(model(tokens, positions=positions), targets)
            loss.backward()
        gaps = {n: (p.grad.full_tensor() - ref_grads[n]).abs().max().item() for n, p in model.named_parameters()}
        return {"loss_gap": abs(loss.full_tensor().item() - ref_loss), "grad_gap": max(gaps.values())}
    finally:
        dist.destroy_process_group()


def test_under_tensor_parallel_the_packed_row_is_one_process():
    for r in launch(_tensor_parallel_packed, LENGTHS, world_size=2, timeout=180):
        assert r["loss_gap"] < 1e-5 and r["grad_gap"] < 1e-5, r
