"""helpers.rpc_compress: round trips, byte counts against the closed forms, and error feedback's conservation."""
from __future__ import annotations

import pytest
import torch

from helpers.rpc_compress import DenseCodec, TopKCodec, decode, make_codec, payload_bytes

SHAPES = [(64, 32), (32,), (10, 32), (10,)]


def grads(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def test_fp32_round_trip_is_exact_and_counts_four_bytes():
    codec = DenseCodec(torch.float32)
    payload = codec.encode(grads(0))
    assert all(torch.equal(a, b) for a, b in zip(decode(payload), grads(0)))
    assert payload_bytes(payload) == codec.expected_bytes(SHAPES) == 4 * (64 * 32 + 32 + 320 + 10)


def test_fp16_halves_bytes_within_rounding():
    codec = DenseCodec(torch.float16)
    payload = codec.encode(grads(1))
    assert payload_bytes(payload) == codec.expected_bytes(SHAPES) == DenseCodec(torch.float32).expected_bytes(SHAPES) // 2
    for a, b in zip(decode(payload), grads(1)):
        assert a.dtype == torch.float32
        assert torch.allclose(a, b, rtol=2 ** -11, atol=1e-7)


def test_topk_keeps_the_largest_entries_and_counts_eight_bytes_each():
    codec = TopKCodec(0.05, error_feedback=False)
    g = grads(2)
    payload = codec.encode(g)
    assert payload_bytes(payload) == codec.expected_bytes(SHAPES)
    assert [len(entry[1]) for entry in payload] == [103, 2, 16, 1]  # ceil(5% of 2048, 32, 320, 10)
    for dense, original in zip(decode(payload), g):
        kept = dense != 0
        k = int(kept.sum())
        threshold = original.abs().flatten().topk(k).values.min()
        assert torch.equal(dense[kept], original[kept])
        assert (original[~kept].abs() <= threshold).all()
    assert codec.residual is None


def test_error_feedback_conserves_every_gradient():
    codec = TopKCodec(0.02)
    sent_total = [torch.zeros(s) for s in SHAPES]
    grad_total = [torch.zeros(s) for s in SHAPES]
    for step in range(25):
        g = grads(100 + step)
        for total, d in zip(sent_total, decode(codec.encode(g))):
            total += d
        for total, d in zip(grad_total, g):
            total += d
    for sent, residual, owed in zip(sent_total, codec.residual, grad_total):
        assert torch.allclose(sent + residual, owed, atol=1e-5)


def test_make_codec_and_validation():
    for spec, dtype in (("fp32", torch.float32), ("fp16", torch.float16)):
        codec = make_codec(spec)
        assert isinstance(codec, DenseCodec) and codec.dtype == dtype and codec.name == spec
    assert make_codec("topk:0.01").error_feedback and not make_codec("topk-noef:0.01").error_feedback
    for bad in ("int8", "topk", "topk:"):
        with pytest.raises(ValueError):
            make_codec(bad)
    with pytest.raises(ValueError):
        TopKCodec(0)
    with pytest.raises(ValueError):
        DenseCodec(torch.int8)
    with pytest.raises(ValueError):
        decode([("zstd", torch.zeros(1))])


def test_every_codec_decodes_and_counts_its_own_payload():
    for spec in ("fp32", "fp16", "topk:0.1", "topk-noef:0.1"):
        codec = make_codec(spec)
        payload = codec.encode(grads(3))
        assert codec.nbytes(payload) == payload_bytes(payload) == codec.expected_bytes(SHAPES)
        assert all(torch.equal(a, b) for a, b in zip(codec.decode(payload), decode(payload)))
