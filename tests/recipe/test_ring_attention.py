"""The recipe's context parallelism (scripts/train/cp.py, written by notebook 08b): the chunks each rank holds, the
online softmax, and ring attention and `apply_cp` against one process on gloo ranks, with the bytes the ring sends; in
bf16, the ring's float32 statistics against bf16 ones, both held against float64."""
from __future__ import annotations

import math
import sys

import pytest
import torch

from helpers.launcher import launch
from helpers.measure.comm_log import CollectiveLog
from helpers.paths import SCRIPTS

sys.path.insert(0, str(SCRIPTS / "train"))
from cp import attend, cp_chunks, cp_positions, merge, visible_blocks  # noqa: E402


def test_balanced_chunks_pair_an_early_one_with_a_late_one_and_cover_the_sequence():
    assert [cp_chunks(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [cp_chunks(r, 4, balanced=False) for r in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    for balanced in (True, False):
        positions = torch.cat([cp_positions(16, r, 4, balanced) for r in range(4)])
        assert sorted(positions.tolist()) == list(range(16))
    assert cp_positions(8, 1, 2).tolist() == [2, 3, 4, 5]


def test_a_sequence_that_does_not_cut_into_2n_chunks_is_refused():
    with pytest.raises(ValueError, match="4 equal chunks: 6 tokens"):
        cp_positions(6, 0, 2)


def test_causal_work_is_equal_on_every_rank_only_with_balanced_chunks():
    def work(n, balanced):
        return [sum(len(visible_blocks(cp_chunks(r, n, balanced), cp_chunks(s, n, balanced))) for s in range(n))
                for r in range(n)]
    assert work(4, True) == [9, 9, 9, 9]               # 2N + 1 blocks each: two diagonals, 2N - 1 whole blocks
    assert work(4, False) == [3, 7, 11, 15]


def test_the_online_softmax_merges_blocks_into_whole_causal_attention():
    q, k, v = (torch.randn(2, 3, 8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(s)) for s in range(3))
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    scale = 1 / math.sqrt(4)
    # the second half of the queries: the first half of the keys whole, then its own half under the diagonal
    later = merge(*attend(q[:, :, 4:], k[:, :, :4], v[:, :, :4], scale, diagonal=False),
                  *attend(q[:, :, 4:], k[:, :, 4:], v[:, :, 4:], scale, diagonal=True))[0]
    earlier = attend(q[:, :, :4], k[:, :, :4], v[:, :, :4], scale, diagonal=True)[0]
    torch.testing.assert_close(torch.cat([earlier, later], dim=2), whole)


def _ring_against_one_process(log_factory):
    """float64 q, k, v (4 query heads, 2 key/value heads): the ring on each rank's chunks against causal SDPA on the
    whole sequence, forward and backward, balanced and contiguous; then the Llama with apply_cp against the plain Llama.
    Returns the largest gaps and the bytes each rank sent."""
    import sys

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, str(SCRIPTS / "train"))
    from config import LlamaArgs
    from cp import RingAttention, apply_cp, cp_positions, cp_shard
    from model import Llama, cross_entropy

    dist.init_process_group("gloo")
    try:
        rank, world, seq = dist.get_rank(), dist.get_world_size(), 24
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
        g = torch.Generator().manual_seed(0)
        q = torch.randn(2, 4, seq, 8, dtype=torch.float64, generator=g)
        k, v = (torch.randn(2, 2, seq, 8, dtype=torch.float64, generator=g) for _ in range(2))
        grad = torch.randn(2, 4, seq, 8, dtype=torch.float64, generator=g)
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        one = F.scaled_dot_product_attention(whole[0], *(t.repeat_interleave(2, 1) for t in whole[1:]), is_causal=True)
        one.backward(grad)
        gaps, sent = [], []
        for balanced in (True, False):
            mine = cp_positions(seq, rank, world, balanced)
            local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
            log = log_factory()
            with log:
                out = RingAttention.apply(*local, mesh.get_group(), balanced)
                out.backward(grad[:, :, mine])
            sent.append(log.bytes("send"))
            pairs = [(out, one[:, :, mine])] + [(a.grad, b.grad[:, :, mine]) for a, b in zip(local, whole)]
            gaps.append(max((a - b).abs().max().item() for a, b in pairs))
        cfg = LlamaArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=seq, multiple_of=16)
        tokens = torch.randint(0, 64, (2, seq + 1), generator=g)
        reference, model = Llama(cfg), Llama(cfg)
        for m in (reference, model):
            m.init_weights(0)
        cross_entropy(reference(tokens[:, :-1]), tokens[:, 1:]).backward()
        apply_cp(model, mesh)
        cross_entropy(model(cp_shard(tokens[:, :-1], mesh)), cp_shard(tokens[:, 1:], mesh)).backward()
        ref = dict(reference.named_parameters())
        model_gap = 0.0
        for name, p in model.named_parameters():
            dist.all_reduce(p.grad)
            model_gap = max(model_gap, (p.grad / world - ref[name].grad).abs().max().item())
        whole_tables = model.rope_cos.shape == reference.rope_cos.shape   # restored after the forward
        return {"gaps": gaps, "sent": sent, "model_gap": model_gap, "whole_tables": whole_tables}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_ring_attention_and_apply_cp_equal_one_process(world):
    for r in launch(_ring_against_one_process, CollectiveLog, world_size=world, timeout=180):
        assert max(r["gaps"]) < 1e-12, "float64: the ring is one process's attention up to rounding"
        block = 2 * 2 * (24 // world) * 8 * 8                  # one rank's keys (or values): float64 bytes
        assert r["sent"] == [(2 * (world - 1) + 4 * (world - 1) + 2) * block] * 2, \
            "forward: N-1 shifts of k, v; backward: N-1 of k, v, dk, dv and one of dk, dv"
        assert r["model_gap"] < 1e-6 and r["whole_tables"]


def _ring_in_bf16(seq):
    """bf16 q, k, v and output gradient (4 query heads, 2 key/value heads, head_dim 64; q and k of standard deviation
    2, so that the scores spread as a trained model's do) through the ring twice, its statistics in float32 (the
    default) and in bf16, each against float64 causal SDPA on the same bf16 numbers. Returns, per run, the
    norm-wise relative error ||ring - reference|| / ||reference|| of the output, dq, dk and dv."""
    import sys

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    sys.path.insert(0, str(SCRIPTS / "train"))
    from cp import RingAttention, cp_positions

    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        g = torch.Generator().manual_seed(0)
        q = (2 * torch.randn(1, 4, seq, 64, generator=g)).bfloat16()
        k = (2 * torch.randn(1, 2, seq, 64, generator=g)).bfloat16()
        v, grad = torch.randn(1, 2, seq, 64, generator=g).bfloat16(), torch.randn(1, 4, seq, 64, generator=g).bfloat16()
        whole = [t.double().requires_grad_() for t in (q, k, v)]
        one = F.scaled_dot_product_attention(whole[0], *(t.repeat_interleave(2, 1) for t in whole[1:]), is_causal=True)
        one.backward(grad.double())
        mine = cp_positions(seq, rank, world)
        errors = {}
        for name, stats in (("float32", None), ("bf16", torch.bfloat16)):
            local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
            out = RingAttention.apply(*local, dist.group.WORLD, True, stats)
            out.backward(grad[:, :, mine])
            assert out.dtype == local[0].grad.dtype == torch.bfloat16, "cast back to the inputs' dtype"
            pairs = [(out, one[:, :, mine])] + [(a.grad, b.grad[:, :, mine]) for a, b in zip(local, whole)]
            errors[name] = [((a.double() - b).norm() / b.norm()).item() for a, b in pairs]
        return errors
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_in_bf16_the_rings_float32_statistics_beat_bf16_ones(world):
    """The tolerance: each float32-statistics result is rounded to bf16 once at the end (8 bits of mantissa: at most
    2^-9 relative), and the backward reads the bf16-rounded output, as flash attention's does (its delta = sum of
    dout x out carries a second rounding, which dp - delta can amplify in the gradients); float32 sums over S = 768
    keys add at most S x 2^-24, about 5e-5. So 2^-8 for the output, 2^-7 for the gradients (measured here: 1.7e-3
    and at most 3.3e-3). With bf16 statistics each score is rounded to bf16, an error of |score| x 2^-9 in the
    exponent of every probability, and the running output and log-sum-exp are rounded at every merge: measured 10
    to 18 times the float32 statistics' error; the test asks for 4."""
    for rank, errors in enumerate(launch(_ring_in_bf16, 768, world_size=world, timeout=300)):
        fp32, bf16 = errors["float32"], errors["bf16"]
        assert fp32[0] < 2 ** -8 and max(fp32[1:]) < 2 ** -7, f"rank {rank}: output, dq, dk, dv {fp32}"
        assert all(b > 4 * f for f, b in zip(fp32, bf16)), f"rank {rank}: float32 {fp32} against bf16 {bf16}"
