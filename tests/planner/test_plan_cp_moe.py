"""The planner's context parallelism (--cp: cp.py's ring attention) and mixture of experts (--moe-experts, --moe-top-k,
--ep: moe.py) against the real code: the parameters of a model built with apply_moe; on one process, the bytes an
MoE forward keeps under every checkpointing mode; on two gloo ranks (one launch), the bytes the ring's and the
experts' forwards keep, the bytes the ring's sends and the experts' all-to-alls carry (with the rows the router
really sent, and on average over the ranks the even-routing estimate), and with FSDP2 beside them each rank's
parameters, gradients and AdamW state and every collective of a step. And the closed forms, the refusals the
recipe makes, and command lines the recipe's argument check accepts.
"""
from __future__ import annotations

import sys
import warnings

import pytest
import torch

from helpers.paths import SCRIPTS

sys.path.insert(0, str(SCRIPTS / "train"))
import plan as P  # noqa: E402
from config import LlamaArgs, preset  # noqa: E402

CFG = LlamaArgs(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=32)
EXPERTS, TOP_K = 4, 2
LOSS_SCALARS = 4 + 8   # alive beside the kept activations: the loss (fp32) and the count its mean divides by (int64)


def moe_model(cfg: LlamaArgs, experts: int = EXPERTS, top_k: int = TOP_K):
    from model import Llama
    from moe import apply_moe

    model = Llama(cfg)
    apply_moe(model, experts, top_k)
    return model


# ------------------------------------------------------------------------------------------------ closed forms

def test_moe_parameters_are_the_models_and_a_token_meets_k_experts():
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in moe_model(CFG).named_parameters()}
    assert shapes == {n: s for n, s, _ in P.parameter_shapes(CFG, EXPERTS)}, "router and stacked experts, by name"
    assert P.count_parameters(lambda: moe_model(CFG)) == P.parameter_count(CFG, EXPERTS)
    ffn = 3 * CFG.dim * CFG.hidden
    total, active = P.parameter_count(CFG, EXPERTS), P.active_parameter_count(CFG, EXPERTS, TOP_K)
    assert total - active == CFG.n_layers * (EXPERTS - TOP_K) * ffn, "the experts a token skips"
    train = P.Training(seq_len=32, moe_experts=EXPERTS, moe_top_k=TOP_K)
    assert P.flops_per_token(CFG, 32, EXPERTS, TOP_K) - CFG.flops_per_token(32) == \
        6 * (active - P.parameter_count(CFG)), "6 FLOPs per weight a token meets"


def test_context_parallel_divides_the_tokens_and_keeps_the_model_state():
    cfg = preset("llama3-8b", max_seq_len=65536)
    one, two = (P.Training(seq_len=65536, batch_size=1, precision="bf16-fsdp", cp=cp) for cp in (1, 2))
    layout = P.Layout(dp_shard=8)
    assert P.model_state(cfg, one, layout, 0) == P.model_state(cfg, two, layout, 0), "FSDP2 shards over all dp_shard"
    a, b = P.layer_activations(cfg, one, 1), P.layer_activations(cfg, two, 1)
    assert all(b[k] == a[k] / 2 for k in a if "attention" not in k and "repeated" not in k), "per-token terms halve"
    kv = cfg.n_kv_heads * cfg.head_dim
    assert b["q rotated, k and v repeated"] == 32768 * (cfg.dim + 2 * kv) * 2, "the ring keeps k, v at kv heads"
    ratio = P.activations(cfg, one, layout, 0)["kept"] / P.activations(cfg, two, layout, 0)["kept"]
    assert 1.9 < ratio < 2.1, "activations per rank fall by about cp (the ring keeps k, v at kv heads, wo's input twice)"
    assert P.data_ranks(layout, two) == 4 and "--cp 2 --batch 8 --accum 2" in P.torchrun_command(
        cfg, P.replace(two, grad_accum=2), layout), "the cp ranks share a batch: 4 read different ones"
    sends = P.ring_sends(cfg, P.replace(two, checkpointing="full"), layout, 0)
    kv_bytes = 32768 * kv * 2
    # forward, recomputed forward, backward's k and v (cp - 1 shifts each), backward's dk and dv in float32 (cp
    # shifts: the last brings them home): twice a bf16 k's bytes per element
    assert [r["buffer_bytes"] for r in sends] == [32 * 2 * kv_bytes, 32 * 2 * kv_bytes, 32 * 2 * kv_bytes,
                                                  32 * 2 * 2 * 2 * kv_bytes]


def test_even_routing_all_to_all_bytes_and_what_leaves_a_rank():
    cfg, layout = preset("small"), P.Layout(dp_shard=8)
    train = P.Training(seq_len=1024, batch_size=2, precision="bf16-fsdp", moe_experts=16, moe_top_k=2, ep=4)
    records = {r["what"]: r for r in P.communication(cfg, train, layout, 0)}
    rows = 2 * 1024 * 2                                     # this rank's tokens, twice each
    a2a = [r for w, r in records.items() if w.startswith("expert all-to-all, d") or w.startswith("expert all-to-all, c")]
    moved = sum(r["buffer_bytes"] for r in a2a) - records["expert all-to-all, counts (int64)"]["buffer_bytes"]
    assert moved == cfg.n_layers * 4 * rows * cfg.dim * 2, "dispatch, combine and both gradients, bf16 rows"
    assert all(r["sent_bytes"] == r["buffer_bytes"] * 3 / 4 for r in a2a), "(ep-1)/ep of it leaves the rank"
    state = P.model_state(cfg, train, layout, 0)
    assert state["expert_elements"] == cfg.n_layers * 3 * 16 // 4 * cfg.dim * cfg.hidden, "E/ep experts whole"
    reduce = records["expert gradients (replicas)"]
    assert (reduce["group_size"], reduce["buffer_bytes"]) == (2, state["expert_elements"] * 4)
    gathered = sum(r["buffer_bytes"] for r in P.communication(cfg, P.replace(train, ep=1), layout, 0)
                   if r["kind"] == "all_gather") - records["FSDP parameters"]["buffer_bytes"]
    assert gathered == 2 * cfg.n_layers * 3 * 16 * cfg.dim * cfg.hidden * 2, "without ep FSDP2 gathers every expert"


@pytest.mark.parametrize("train,layout,says", [
    (P.Training(seq_len=64, cp=2), P.Layout(dp_shard=2, tp=2), "--cp with --tp or --pp"),
    (P.Training(seq_len=60, cp=4), P.Layout(dp_shard=4), "8 equal chunks: --seq-len 60"),
    (P.Training(seq_len=64, cp=2, compile=True), P.Layout(dp_shard=2), "add --no-compile"),
    (P.Training(seq_len=64, cp=4), P.Layout(dp_shard=2), "--cp 4 ranks are taken out of --dp-shard 2"),
    (P.Training(seq_len=64, moe_experts=4, ep=4), P.Layout(dp_shard=2), "--ep 4 ranks come out of --dp-shard 2"),
    (P.Training(seq_len=64, moe_experts=4, cp=2), P.Layout(dp_shard=2), "--moe-experts with --tp, --pp or --cp"),
    (P.Training(seq_len=64, moe_experts=4), P.Layout(pp=2), "--moe-experts with --tp, --pp or --cp"),
])
def test_what_the_recipe_refuses_is_refused_in_one_line(train, layout, says):
    with pytest.raises(ValueError, match=says) as e:
        P.check_layout(P.replace(CFG, max_seq_len=64), P.replace(train, grad_accum=2), layout)
    assert "\n" not in str(e.value)


def test_bad_expert_settings_are_refused():
    for bad, layout, says in ((dict(ep=2), P.Layout(dp_shard=2), "--ep 2 shares out experts"),
                              (dict(moe_experts=4, moe_top_k=5), P.Layout(), "--moe-top-k 5 must be between 1 and"),
                              (dict(moe_experts=6, ep=4), P.Layout(dp_shard=4), "must divide both")):
        with pytest.raises(ValueError, match=says):
            P.check_layout(P.replace(CFG, max_seq_len=64), P.Training(seq_len=64, **bad), layout)
    with pytest.raises(ValueError, match="--cp must be at least 1, got 0"):
        P.Training(cp=0)


def test_the_command_line_plans_cp_and_experts_as_the_recipe_runs_them(capsys, monkeypatch):
    import train as recipe

    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setattr(recipe, "uses_gpu", lambda: False)
    for argv, wanted in ((["--model", "llama3-8b", "--cp", "2", "--seq-len", "32768"], "--cp 2 --batch 8"),
                         (["--model", "small", "--moe-experts", "8", "--ep", "8"], "--moe-experts 8 --moe-top-k 2 --ep 8")):
        P.main(["--gpus", "8", "--top", "1", *argv])
        command = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("$ torchrun"))
        assert wanted in command and "--no-compile" in command, "the recipe runs the ring and the experts eager"
        args = recipe.parse_args(command.split("scripts/train/train.py", 1)[1].split())
        assert args.batch == 8 and args.dims.world == 8


# ------------------------------------------------------------------------------------------- one process, MoE

@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_moe_activations_are_what_a_forward_keeps(precision, checkpointing):
    # one process: each expert takes its routed rows, whatever their spread, so the count is exact: the tensors a
    # forward made and left alive are the plan's kept activations (the MoE blocks' statistics in) and the loss (8 B)
    import gc

    from ac import apply_ac
    from helpers.measure.activations import LiveTensorBytes
    from model import cross_entropy

    torch.manual_seed(0)
    model = moe_model(CFG)
    model.init_weights()
    apply_ac(model, checkpointing)
    live = LiveTensorBytes()
    with live, torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16-autocast"):
        x, y = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
        loss = cross_entropy(model(x), y)
        gc.collect()
        alive = live.current
    assert loss.requires_grad, "the graph, and what it keeps, alive"
    train = P.Training(seq_len=32, batch_size=2, precision=precision, checkpointing=checkpointing,
                       fused_rms_norm=False, moe_experts=EXPERTS, moe_top_k=TOP_K)
    assert alive == P.activations(CFG, train, P.Layout(), 0)["kept"] + LOSS_SCALARS


# ------------------------------------------------------------------------------------------------ two gloo ranks

def _two_rank_worker(cfg, experts, top_k, batch, scripts):
    """On 2 ranks: (1) the recipe's Llama with apply_cp under each --ac: the bytes one forward leaves alive and the
    bytes the ring sends in forward and backward; (2) with apply_moe and apply_ep: the same, with each all-to-all's
    bytes and the rows the router sent to each expert; (3) each under FSDP2 over both ranks (the experts outside
    it, whole on their rank), one AdamW step: this rank's model state and every collective of a second step."""
    import gc
    import sys
    import time

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sys.path.insert(0, scripts)
    import parallelize as par
    from ac import apply_ac
    from cp import apply_cp, cp_shard
    from helpers.measure.activations import LiveTensorBytes
    from helpers.measure.comm_log import CollectiveLog
    from helpers.measure.memory import allocated_state_bytes, model_state_bytes
    from model import Llama, cross_entropy
    from moe import apply_ep, apply_moe

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    try:
        rank, out = dist.get_rank(), {}
        cp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))["cp"]
        ep_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))["ep"]
        shard_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
        tokens = torch.randint(0, cfg.vocab_size, (2 * batch, cfg.max_seq_len + 1),
                               generator=torch.Generator().manual_seed(0))

        def build(kind, ac="none", fsdp=False):     # as the recipe builds: meta, apply_*, materialize, init
            with torch.device("meta"):
                model = Llama(cfg)
            if kind == "cp":
                apply_cp(model, cp_mesh)
            else:
                apply_moe(model, experts, top_k)
                apply_ep(model, ep_mesh)
            apply_ac(model, ac)
            if fsdp and kind == "cp":
                par.apply_fsdp(model, shard_mesh)
            elif fsdp:                              # the experts are no FSDP2 parameters: each rank holds its own
                mine = {p for n, p in model.named_parameters() if ".experts." in n}
                for block in model.layers.values():
                    fully_shard(block, mesh=shard_mesh, ignored_params=mine, reshard_after_forward=True)
                fully_shard(model, mesh=shard_mesh, ignored_params=mine, reshard_after_forward=True)
            model.to_empty(device="cpu")
            model.init_weights(0)
            return model

        def batch_of(kind):                         # cp: both ranks the same sequences, a half each; ep: its own
            if kind == "cp":
                return cp_shard(tokens[:batch, :-1], cp_mesh), cp_shard(tokens[:batch, 1:], cp_mesh)
            mine = slice(rank * batch, (rank + 1) * batch)
            return tokens[mine, :-1].clone(), tokens[mine, 1:].clone()

        def settled(live, interval=0.01, readings=3, deadline=60.0):
            """The live bytes once they stop changing: a gloo worker thread drops a finished collective's buffers a
            moment after the call returned (later on a busy machine), and a reference cycle's at the next gc."""
            seen, stop = [], time.monotonic() + deadline
            while len(seen) < readings or len(set(seen[-readings:])) > 1:
                if time.monotonic() > stop:
                    raise TimeoutError(f"live bytes still changing after {deadline} s: {seen[-readings:]}")
                gc.collect()
                seen.append(live.current)
                time.sleep(interval)
            return seen[-1]

        def routed(model):
            return [b.feed_forward.tokens_per_expert.tolist() for b in model.layers.values()] \
                if hasattr(model.layers["0"].feed_forward, "tokens_per_expert") else None

        for kind in ("cp", "ep"):
            for ac in ("none", "full", "selective"):
                model, live, log = build(kind, ac), LiveTensorBytes(), CollectiveLog()
                with live, log:
                    x, y = batch_of(kind)
                    loss = cross_entropy(model(x), y)
                    alive = settled(live)
                    loss.backward()
                out[kind, ac] = {"alive": alive, "routed": routed(model),
                                 "sent": [(c.kind, c.bytes) for c in log.calls if c.kind in ("send", "all_to_all")]}
            model = build(kind, fsdp=True)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for step in range(2):                   # the first makes AdamW's state; the second is logged
                log = CollectiveLog()
                with log:
                    x, y = batch_of(kind)
                    cross_entropy(model(x), y).backward()
                    if kind == "cp":                # the experts' DTensors live on another mesh than FSDP2's
                        par.clip_grad_norm_(model.parameters(), 1.0)
                state = {"held": model_state_bytes(model, opt), "allocated": allocated_state_bytes(model, opt)}
                opt.step()
                opt.zero_grad(set_to_none=True)
            out[kind, "fsdp"] = {**state, "log": log.summary(), "routed": routed(model)}
        return out
    finally:
        gc.collect()
        dist.destroy_process_group()


def _rows_taken(results, key, rank):
    """Rows the experts of `rank` took in each block: every rank's assignments to them (rank r: experts r·E/2 ...)."""
    mine = range(rank * EXPERTS // 2, (rank + 1) * EXPERTS // 2)
    return [sum(r[key]["routed"][block][e] for r in results for e in mine) for block in range(CFG.n_layers)]


def _planned(records):
    out = {}
    for c in records:
        entry = out.setdefault(c["kind"], {"calls": 0, "bytes": 0})
        entry["calls"] += c["calls"]
        entry["bytes"] += c["buffer_bytes"]
    return out


def _ring_checks(two_ranks, checkpointing):
    # each rank holds 16 of the 32 tokens (chunks i and 3 - i); the ring keeps q, k, v at kv heads, its output and
    # log-sum-exp, wo's input copy, the gathered rotary slices; selective checkpointing its score blocks too
    train = P.Training(seq_len=32, batch_size=2, cp=2, fused_rms_norm=False, checkpointing=checkpointing)
    act = P.activations(CFG, train, P.Layout(dp_shard=2), 0)
    sends = P.ring_sends(CFG, train, P.Layout(dp_shard=2), 0)
    for r in two_ranks:
        measured = r["cp", checkpointing]
        assert measured["alive"] == act["kept"] + LOSS_SCALARS
        assert [b for _, b in measured["sent"]] and sum(b for _, b in measured["sent"]) == \
            sum(s["buffer_bytes"] for s in sends), "k, v (and dk, dv) around the ring, a recomputed forward again"
        assert len(measured["sent"]) == sum(s["calls"] for s in sends)


def _expert_checks(two_ranks, checkpointing):
    # with the rows the router really sent to each rank's experts the count is exact, rank by rank; under even
    # routing it is the ranks' mean (what one rank receives more, the other receives less)
    key = ("ep", checkpointing)
    train = P.Training(seq_len=32, batch_size=2, moe_experts=EXPERTS, moe_top_k=TOP_K, ep=2, fused_rms_norm=False,
                       checkpointing=checkpointing)
    layout, planned_bytes = P.Layout(dp_shard=2), []
    for rank, r in enumerate(two_ranks):
        rows = _rows_taken(two_ranks, key, rank)
        even = P.activations(CFG, train, layout, rank)["kept"]
        if checkpointing == "none":
            exact = even + sum(sum(P.moe_activations(CFG, train, n).values()) - sum(P.moe_activations(CFG, train)
                                                                                   .values()) for n in rows)
        elif checkpointing == "selective":                 # w1, w3 and w2 outputs per row taken
            exact = even + sum(n - P.moe_rows(train) for n in rows) * (2 * CFG.hidden + CFG.dim) * 4
        else:
            exact = even
        assert r[key]["alive"] == exact + LOSS_SCALARS, f"rank {rank}: rows taken {rows}"
        planned = P.expert_collectives(CFG, train, layout, rank, rows)
        a2a = [b for kind, b in r[key]["sent"] if kind == "all_to_all"]
        assert len(a2a) == sum(c["calls"] for c in planned if c["kind"] == "all_to_all")
        assert sum(a2a) == sum(c["buffer_bytes"] for c in planned if c["kind"] == "all_to_all")
        planned_bytes.append(sum(a2a))
    even = sum(c["buffer_bytes"] for c in P.expert_collectives(CFG, train, layout, 0) if c["kind"] == "all_to_all")
    assert sum(planned_bytes) == 2 * even and planned_bytes[0] != planned_bytes[1], "uneven, even on average"


def _fsdp_checks(two_ranks, kind):
    train = P.Training(seq_len=32, batch_size=2, **({"cp": 2} if kind == "cp" else
                                                    {"moe_experts": EXPERTS, "moe_top_k": TOP_K, "ep": 2}))
    layout = P.Layout(dp_shard=2)
    for rank, r in enumerate(two_ranks):
        measured = r[kind, "fsdp"]
        state = P.model_state(CFG, train, layout, rank)
        assert measured["held"] == state["held"] and measured["allocated"] == state["allocated"], f"rank {rank}"
        planned = P.communication(CFG, train, layout, rank)
        if kind == "ep":                                # exact rows; no clipping (see the worker)
            rows = _rows_taken(two_ranks, (kind, "fsdp"), rank)
            planned = [c for c in planned if c["kind"] != "all_to_all" and not c["what"].startswith("gradient norm")]
            planned += P.expert_collectives(CFG, train, layout, rank, rows)
        logged = {k: {"calls": v["calls"], "bytes": v["bytes"]} for k, v in measured["log"].items() if k != "recv"}
        assert logged == _planned(planned), f"{kind}, rank {rank}: collectives of one step (calls and bytes)"


def test_ring_and_experts_keep_and_send_what_the_plan_says_on_two_ranks():
    # one launch for every check (a module fixture would launch once per pytest-xdist worker)
    import helpers

    results = helpers.launch(_two_rank_worker, CFG, EXPERTS, TOP_K, 2, str(SCRIPTS / "train"), world_size=2,
                             timeout=600, quiet=True)  # 39 s on a loaded 2-core machine
    for checkpointing in ("none", "full", "selective"):
        _ring_checks(results, checkpointing)
        _expert_checks(results, checkpointing)
    for kind in ("cp", "ep"):
        _fsdp_checks(results, kind)
