"""The recipe's mixture of experts (scripts/train/moe.py, written by notebook 08b): the routed layer against a token by
token computation, the load-balancing loss, apply_moe on the model, and on gloo ranks expert parallelism against one
process, the all-to-all bytes against their formula, and a dispatch and combine that give back what they took."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from helpers.launcher import launch
from helpers.measure.comm_log import CollectiveLog
from helpers.paths import SCRIPTS

sys.path.insert(0, str(SCRIPTS / "train"))
from config import LlamaArgs  # noqa: E402
from model import Llama  # noqa: E402
from moe import MoE, apply_moe, moe_aux_loss  # noqa: E402


def _moe(dim=16, hidden=24, n_experts=4, top_k=2, seed=0):
    torch.manual_seed(seed)
    moe = MoE(dim, hidden, n_experts, top_k).double()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.3)
    return moe


def test_every_token_gets_its_top_k_experts_weighted_by_the_renormalized_router_scores():
    moe, x = _moe(), torch.randn(3, 5, 16, dtype=torch.float64)
    w1, w3, w2 = (moe.experts[n].weight for n in ("w1", "w3", "w2"))
    expected = torch.zeros_like(x)
    for b in range(3):
        for t in range(5):
            scores = moe.router(x[b, t]).softmax(-1)
            top, chosen = scores.topk(2)
            for weight, e in zip(top / top.sum(), chosen.tolist()):
                expected[b, t] += weight * (F.silu(w1[e] @ x[b, t]) * (w3[e] @ x[b, t])) @ w2[e].T
    torch.testing.assert_close(moe(x), expected)
    assert moe.tokens_per_expert.sum().item() == 3 * 5 * 2, "dropless: every token's k assignments are computed"


def test_the_load_balancing_loss_is_one_when_even_and_n_experts_when_one_expert_takes_everything():
    moe = _moe(n_experts=4, top_k=1)
    x = torch.zeros(64, 16, dtype=torch.float64)
    x[torch.arange(64), torch.arange(64) % 4] = 1.0      # token i points at expert i % 4
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[:, :4] = 20 * torch.eye(4)     # ... and the router follows, confidently
    moe(x)
    assert moe.tokens_per_expert.tolist() == [16, 16, 16, 16]
    assert moe.aux_loss.item() == pytest.approx(1.0, abs=1e-6)      # E x sum of 1/4 x 1/4
    with torch.no_grad():
        moe.router.weight[0, :4] = 40.0                  # expert 0 outbids the others on every token
    moe(x)
    assert moe.tokens_per_expert.tolist() == [64, 0, 0, 0]
    assert moe.aux_loss.item() == pytest.approx(4.0, abs=1e-6)      # E x (1 x 1)


def test_the_load_balancing_loss_is_at_most_n_experts_over_top_k():
    """A token's k choices are k different experts, so an expert's share of the assignments is at most 1/k; the mean
    probabilities sum to 1: the loss is at most E/k, and near it when every token sends its probability to the
    same k experts."""
    moe = _moe(n_experts=8, top_k=2)
    x = torch.zeros(64, 16, dtype=torch.float64)
    x[:, 0] = 1.0
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[:2, 0] = 30.0                  # experts 0 and 1 outbid the rest on every token
    moe(x)
    assert moe.tokens_per_expert.tolist() == [64, 64, 0, 0, 0, 0, 0, 0]
    assert moe.aux_loss.item() == pytest.approx(8 / 2, rel=1e-9)      # E x (1/2 x 1/2 + 1/2 x 1/2)
    for seed in range(20):                               # routers of every spread, tokens of every kind
        moe = _moe(n_experts=8, top_k=2, seed=seed)
        with torch.no_grad():
            moe.router.weight.mul_(10.0 * seed)
        moe(torch.randn(32, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)))
        assert 0 < moe.aux_loss.item() <= 8 / 2 + 1e-12


def test_top_k_outside_one_to_n_experts_is_refused():
    with pytest.raises(ValueError, match="top_k 5 must be between 1 and n_experts 4"):
        MoE(8, 8, 4, 5)


def test_apply_moe_swaps_every_feed_forward_and_init_weights_draws_the_experts():
    cfg = LlamaArgs(vocab_size=32, dim=32, n_layers=2, n_heads=4, multiple_of=16, max_seq_len=8)
    with torch.device("meta"):
        model = Llama(cfg)
        apply_moe(model, n_experts=4, top_k=2)
    model.to_empty(device="cpu")
    model.init_weights(0)
    names = {n: p for n, p in model.named_parameters() if ".feed_forward." in n}
    assert sorted(names) == sorted(f"layers.{i}.feed_forward.{w}.weight" for i in range(2)
                                   for w in ("router", "experts.w1", "experts.w2", "experts.w3"))
    assert names["layers.0.feed_forward.experts.w1.weight"].shape == (4, cfg.hidden, 32)
    # w2 writes into the residual stream: init_weights gives it the smaller std, as it gives the dense w2
    assert names["layers.0.feed_forward.experts.w2.weight"].std().item() < 0.6 * 0.02
    tokens = torch.randint(0, 32, (2, 8))
    model(tokens)
    assert moe_aux_loss(model).item() > 0 and moe_aux_loss(Llama(cfg)).item() == 0


def _expert_parallel_against_one_process(log_factory):
    """The Llama with MoE feed-forwards, experts sharded over the ranks (each rank half the batch) against one process
    (the whole batch); the all-to-all bytes; AllToAll there and back, forward and backward."""
    import sys

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    sys.path.insert(0, str(SCRIPTS / "train"))
    from config import LlamaArgs
    from model import Llama
    from moe import AllToAll, apply_ep, apply_moe

    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))["ep"]
        cfg = LlamaArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16, max_seq_len=8)
        tokens = torch.randint(0, 64, (2 * world, 9), generator=torch.Generator().manual_seed(0))
        x, y = tokens[:, :-1], tokens[:, 1:]
        mine = slice(2 * rank, 2 * rank + 2)

        def build(ep):
            with torch.device("meta"):
                model = Llama(cfg)
            apply_moe(model, n_experts=2 * world, top_k=2)
            if ep:
                apply_ep(model, mesh)
            model.to_empty(device="cpu")
            model.init_weights(0)
            return model

        def loss(model, x, y):
            return F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum") / tokens[:, 1:].numel()

        reference, model, log = build(False), build(True), log_factory()
        loss(reference, x, y).backward()
        with log:
            loss(model, x[mine], y[mine]).backward()
        ref, gap = dict(reference.named_parameters()), 0.0
        for name, p in model.named_parameters():
            if isinstance(p, DTensor):
                want = distribute_tensor(ref[name].grad, mesh, p.placements, src_data_rank=None).to_local()
                gap = max(gap, (p.grad.to_local() - want).abs().max().item())
            else:
                dist.all_reduce(p.grad)
                gap = max(gap, (p.grad - ref[name].grad).abs().max().item())
        # AllToAll there and back: rank r sends r + 1 rows to every rank; what comes back is what left, and so
        # is the gradient
        rows = torch.randn(world * (rank + 1), 3, requires_grad=True)
        send, recv = [rank + 1] * world, [r + 1 for r in range(world)]
        back = AllToAll.apply(AllToAll.apply(rows, recv, send, mesh.get_group()), send, recv, mesh.get_group())
        back.backward(torch.ones_like(back) * 2)
        round_trip = torch.equal(back, rows) and torch.equal(rows.grad, torch.full_like(rows, 2.0))
        per_expert = [b.feed_forward.tokens_per_expert.tolist() for b in model.layers.values()]
        return {"gap": gap, "a2a": [c.bytes for c in log.calls if c.kind == "all_to_all"], "per_expert": per_expert,
                "tokens": x[mine].numel(), "round_trip": round_trip}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_equals_one_process_and_moves_the_bytes_of_the_formula(world):
    results = launch(_expert_parallel_against_one_process, CollectiveLog, world_size=world, timeout=180)
    n_experts, local, top_k, dim = 2 * world, 2, 2, 32
    for rank, r in enumerate(results):
        assert r["gap"] < 1e-6, "forward and every gradient as one process"
        assert r["round_trip"], "dispatch then combine gives back the rows, and their gradients"
        received = [sum(o["per_expert"][layer][e] for o in results for e in range(rank * local, (rank + 1) * local))
                    for layer in range(2)]
        # per MoE layer in forward: the counts (n_experts int64), dispatch, combine; in backward, from the last layer:
        # the combine's, then the dispatch's
        out = r["tokens"] * top_k * dim * 4
        assert r["a2a"] == [b for rows in received for b in (n_experts * 8, out, rows * dim * 4)] + \
            [b for rows in received[::-1] for b in (out, rows * dim * 4)]
