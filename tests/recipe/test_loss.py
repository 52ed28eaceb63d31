"""The recipe's loss (scripts/train/model.py's `cross_entropy`, written by notebook 03): a chunked cross-entropy equal
to `F.cross_entropy` on float32 logits, targets -100 left out, in its value and its gradients; the bytes it saves for
backward and the peak of the bytes a forward and backward allocate, at a 32k and a 128k vocabulary, against the plain
loss; and under tensor parallel's `loss_parallel`, where the logits are a DTensor split over the vocabulary."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from helpers.launcher import launch
from helpers.measure.activations import LiveTensorBytes, SavedActivations
from helpers.paths import SCRIPTS

sys.path.insert(0, str(SCRIPTS / "train"))
import model  # noqa: E402
from model import IGNORE_INDEX, cross_entropy  # noqa: E402


def plain_loss(logits, targets, reduction="mean"):
    """What the recipe's loss was: F.cross_entropy on a float32 copy of every logit."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction=reduction)


def _logits_and_targets(dtype, vocab=1000, shape=(3, 50)):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(*shape, vocab, generator=g)).to(dtype)
    targets = torch.randint(0, vocab, shape, generator=g)
    targets[0, :20] = IGNORE_INDEX          # a prompt: no targets there
    targets[2, -5:] = IGNORE_INDEX          # padding
    return logits, targets


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_loss_equals_cross_entropy_on_float32_logits(monkeypatch, dtype, reduction):
    """Tolerances: the loss is a float32 sum of the same float32 numbers in another order (a log-sum-exp per chunk
    against a log-softmax), so 1e-6 relative, in both dtypes (bf16 logits are widened exactly). The gradient is
    float32 arithmetic too, then written in the logits' dtype: float32 logits 1e-6 of the largest gradient; bf16
    logits one bf16 rounding of it, 2^-8 of the largest (both paths round a float32 gradient to 8 bits)."""
    monkeypatch.setattr(model, "LOSS_CHUNK_BYTES", 4 * 1000 * 7)        # 7 rows a chunk: 22 chunks, the last short
    logits, targets = _logits_and_targets(dtype)
    ours, theirs = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss, reference = cross_entropy(ours, targets, reduction), plain_loss(theirs, targets, reduction)
    (loss * 3).backward()
    (reference * 3).backward()
    assert loss.dtype == torch.float32 and ours.grad.dtype == dtype
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=0)
    largest = theirs.grad.abs().max().item()
    torch.testing.assert_close(ours.grad.float(), theirs.grad.float(), rtol=0,
                               atol=(1e-6 if dtype == torch.float32 else 2 ** -8) * largest)
    assert ours.grad[0, :20].abs().max() == 0 and ours.grad[2, -5:].abs().max() == 0, "no target, no gradient"


@pytest.mark.parametrize("vocab", [32768, 131072], ids=["32k", "128k"])
def test_the_chunked_loss_saves_bf16_logits_and_a_float32_per_row_and_lowers_the_peak(monkeypatch, vocab):
    """bf16 logits of 128 tokens from an output projection (dim 64), the loss, its backward. Saved for backward by
    the loss (SavedActivations: the pack hook of saved_tensors_hooks): the plain loss keeps a float32 log-softmax,
    4 bytes a logit; the chunked one the bf16 logits themselves, one float32 per row, the targets and their count
    (an int64 the mean divides by). The peak of
    the bytes allocated in forward and backward (LiveTensorBytes: every tensor made in the region while it lives):
    the chunked loss holds the logits, their gradient (both bf16) and one chunk of float32 rows at a time."""
    chunk_bytes = 2 ** 22
    monkeypatch.setattr(model, "LOSS_CHUNK_BYTES", chunk_bytes)
    tokens, dim = 128, 64
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, tokens, dim, generator=g).bfloat16().requires_grad_()
    weight = torch.nn.Parameter((0.02 * torch.randn(vocab, dim, generator=g)).bfloat16())
    targets = torch.randint(0, vocab, (1, tokens), generator=g)
    logit_bytes = tokens * vocab * 2
    measured = {}
    for name, loss_fn in (("plain", plain_loss), ("chunked", cross_entropy)):
        with LiveTensorBytes() as live:
            logits = h @ weight.T
            with SavedActivations() as saved:
                loss = loss_fn(logits, targets)
            del logits
            loss.backward()
        measured[name] = {"saved": saved.bytes, "peak": live.peak}
        h.grad = weight.grad = None
    print(f"vocab {vocab:,}, {tokens} tokens, bf16 logits {logit_bytes / 2 ** 20:.0f} MiB: {measured}")
    plain, chunked = measured["plain"], measured["chunked"]
    assert plain["saved"] >= 2 * logit_bytes, "the plain loss keeps every logit in float32"
    assert chunked["saved"] == logit_bytes + 4 * tokens + targets.nbytes + 8, \
        "the chunked loss keeps the bf16 logits, one float32 log-sum-exp per row, the targets and their count"
    grads = h.numel() * 2 + weight.numel() * 2
    assert chunked["peak"] <= 2 * logit_bytes + chunk_bytes + grads + 64 * tokens, \
        "logits and their gradient in bf16, one chunk of float32 rows, the input's and weight's gradients"
    assert plain["peak"] >= logit_bytes + 2 * (2 * logit_bytes), "plain: the float32 copy and its log-softmax at once"


def _loss_parallel_equals_one_process(reduction):
    """Logits split over the vocabulary (tensor parallel's Shard(-1) DTensor) under loss_parallel, against the
    same logits whole in one process; targets with -100."""
    import sys

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    sys.path.insert(0, str(SCRIPTS / "train"))
    from model import IGNORE_INDEX, cross_entropy

    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        g = torch.Generator().manual_seed(0)
        logits, targets = torch.randn(2, 6, 64, generator=g), torch.randint(0, 64, (2, 6), generator=g)
        targets[0, :3] = IGNORE_INDEX
        whole = logits.clone().requires_grad_()
        reference = cross_entropy(whole, targets, reduction)
        reference.backward()
        split = distribute_tensor(logits, mesh, [Shard(-1)]).requires_grad_()
        with loss_parallel():
            loss = cross_entropy(split, targets, reduction)
            loss.backward()
        return {"gap": abs(loss.full_tensor().item() - reference.item()),
                "grad_gap": (split.grad.full_tensor() - whole.grad).abs().max().item()}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_under_loss_parallel_the_loss_and_its_gradient_are_one_process(reduction):
    for r in launch(_loss_parallel_equals_one_process, reduction, world_size=2, timeout=180):
        assert r["gap"] < 1e-5 and r["grad_gap"] < 1e-6, r
