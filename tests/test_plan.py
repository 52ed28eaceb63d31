"""The planner (scripts/train/plan.py) against hand-worked cases, published formulas and real runs on CPU ranks.

Hand-worked: FSDP2's padded shards of a small model, row by row. Published: ZeRO's 16 bytes per parameter for
mixed-precision Adam (16Ψ/N fully sharded), the Ultra-Scale Playbook's table of model-state memory, and the
per-layer activation formula of Korthikanti et al. (2022) that the Playbook uses, with the terms that do not apply
to this model (dropout masks, stored s^2 scores) taken out one by one. Real: the parameter count of the model, the
bytes autograd saves in a forward, and the bytes of parameters, gradients, AdamW state and collectives that FSDP2
and DDP hold and send on two gloo ranks.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from scripts.train import plan as P

# ------------------------------------------------------------------------------------------------ the model
# The recipe's own GPT (scripts/train/model.py), built from the planner's configuration.


def recipe_gpt(cfg: P.ModelConfig):
    from scripts.train.model import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=cfg.vocab_size, dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                         max_seq_len=cfg.max_seq_len, mlp_ratio=cfg.mlp_ratio))


SMALL = P.ModelConfig(vocab_size=7, dim=4, n_layers=1, n_heads=2, max_seq_len=5, mlp_ratio=4)


# ---------------------------------------------------------------------------------------------- parameter count

@pytest.mark.parametrize("cfg", [SMALL, P.ModelConfig(), P.ModelConfig(vocab_size=32000, dim=4096, n_layers=32,
                                                                          n_heads=32, max_seq_len=4096)])
def test_parameter_count_is_the_models(cfg):
    built = P.count_parameters(lambda: recipe_gpt(cfg))
    assert P.parameter_count(cfg) == built
    v, d, s, L, h = cfg.vocab_size, cfg.dim, cfg.max_seq_len, cfg.n_layers, cfg.hidden
    assert built == v * d + s * d + L * (4 * d * d + 2 * d * h + 2 * d) + d + d * v   # the spec's formula
    from scripts.train.model import GPTConfig

    assert built == GPTConfig(vocab_size=v, dim=d, n_layers=L, n_heads=cfg.n_heads, max_seq_len=s,
                              mlp_ratio=cfg.mlp_ratio).num_params()
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in recipe_gpt(cfg).named_parameters()}
    assert shapes == {n: s for n, s, _ in P.parameter_shapes(cfg)}, "the planner knows every parameter's shape"


# ------------------------------------------------------------------------------------------------- model state

def test_fsdp_padding_worked_by_hand():
    # SMALL on dp_shard = 2: dim-0 rows per parameter, rank 0 | rank 1 (torch.chunk: ceil first, the rest after):
    # tok (7,4): 4|3, pos (5,4): 3|2, norms (4,): 2|2 (x3), wq..wo (4,4): 2|2 (x4), w1 (16,4): 8|8, w2 (4,16): 2|2,
    # output (7,4): 4|3. Elements: rank 0 16+12+2+32+2+32+32+2+16 = 146; rank 1 12+8+2+32+2+32+32+2+12 = 134.
    # Both allocate rank 0's padded 146; together they hold all 280 parameters.
    layout, train = P.Layout(dp_shard=2), P.Training(seq_len=5, batch_size=1)
    r0, r1 = (P.model_state(SMALL, train, layout, r) for r in (0, 1))
    assert (r0["elements"], r1["elements"], r1["padded_elements"]) == (146, 134, 146)
    assert r0["elements"] + r1["elements"] == P.parameter_count(SMALL) == 280
    assert r1["held"] == {"parameters": 134 * 4, "gradients": 134 * 4, "optimizer": 134 * 8}
    assert r1["allocated"] == {"parameters": 146 * 4, "gradients": 146 * 4, "optimizer": 134 * 8}


@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast", "bf16-fsdp"])
def test_zero_sixteen_bytes_per_parameter_and_sixteen_psi_over_n(precision):
    # ZeRO (Rajbhandari et al. 2020): mixed-precision Adam holds 2Ψ + 2Ψ + 12Ψ = 16Ψ bytes; fully sharded over N
    # ranks (stage 3) 16Ψ/N each. FSDP2's split of the 16 differs (fp32 master weights and fp32 gradients, 4 + 4 +
    # 8, the bf16 copy only while gathered) but the sum is ZeRO's. Every dim 0 below divides by 4 and 8.
    cfg = P.ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=64)
    psi = P.parameter_count(cfg)
    train = P.Training(seq_len=64, batch_size=1, precision=precision)
    assert sum(P.model_state(cfg, train, P.Layout(), 0)["held"].values()) == 16 * psi
    sgd = P.model_state(cfg, P.replace(train, optimizer="sgd"), P.Layout(), 0)["held"]
    assert sgd["optimizer"] == 4 * psi, "SGD with momentum: one fp32 buffer, 12 bytes per parameter in all"
    for n in (4, 8):
        for rank in range(n):
            state = P.model_state(cfg, train, P.Layout(dp_shard=n), rank)
            assert sum(state["held"].values()) == sum(state["allocated"].values()) == 16 * psi / n
    # ZeRO's figure: a 7.5B-parameter model needs 120 GB of model state, 1.875 GB per rank at N = 64.
    assert 16 * 7.5e9 / 1e9 == 120 and 16 * 7.5e9 / 64 / 1e9 == 1.875


def test_playbook_model_state_table():
    # The Ultra-Scale Playbook tabulates model-state memory with Adam in mixed precision (bf16 parameters and
    # gradients plus fp32 master weights and two moments) at 2 + 2 + 4 + 8 = 16 bytes per parameter: 112 GB for
    # 7B and 1120 GB for 70B. Our GPT at 7B's shape (32 layers of 4096, a 32000 vocabulary) has about 6.7B
    # parameters, so the planner's one-rank total is the table's 112 GB scaled by the count.
    cfg = P.ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, max_seq_len=4096)
    psi = P.parameter_count(cfg)
    held = P.model_state(cfg, P.Training(seq_len=4096, batch_size=1, precision="bf16-fsdp"), P.Layout(), 0)["held"]
    assert sum(held.values()) == pytest.approx(112e9 * psi / 7e9, rel=1e-12)
    assert 6.5e9 < psi < 7e9


def test_tensor_parallel_splits_the_projections_and_fsdp_splits_what_is_left():
    cfg = P.ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=64)
    train = P.Training(seq_len=64, batch_size=1)
    tp2 = P.model_state(cfg, train, P.Layout(tp=2), 0)["elements"]
    # the norms stay whole; the embeddings, projections and output are halved
    replicated = sum(math.prod(s) for _, s, d in P.parameter_shapes(cfg) if d is None)
    assert tp2 == replicated + (P.parameter_count(cfg) - replicated) // 2
    fsdp_tp = [P.model_state(cfg, train, P.Layout(dp_shard=2, tp=2), r)["elements"] for r in range(4)]
    assert sum(fsdp_tp) == 2 * tp2 and fsdp_tp[0] == fsdp_tp[1] == tp2 / 2   # tp fastest: ranks 0, 1 differ in tp


def test_pipeline_stages_split_the_layers_and_the_ends():
    cfg = P.ModelConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, max_seq_len=64)
    train = P.Training(seq_len=64, batch_size=1, grad_accum=2)
    layout = P.Layout(pp=2)
    first, last = (P.model_state(cfg, train, layout, r)["elements"] for r in (0, 1))
    assert first + last == P.parameter_count(cfg)
    assert first - last == 64 * 64 - 64   # positions on the first stage; the final norm on the last
    names = [n for n, _, _ in P.stage_parameters(cfg, layout, 1)]
    assert names[0] == "layers.2.attention_norm.weight" and names[-1] == "output.weight"


# ------------------------------------------------------------------------------------------------- activations

def _korthikanti(s, b, h, a, t=1):
    """Korthikanti et al. (2022), eq. for tensor + sequence parallelism, bytes per layer in 16-bit: the formula
    the Ultra-Scale Playbook quotes (with t = 1): s*b*h*(34/t + 5*a*s/(h*t))."""
    return s * b * h * (34 / t + 5 * a * s / (h * t))


@pytest.mark.parametrize("s,b,h,a", [(2048, 1, 4096, 32), (1024, 8, 768, 12)])
def test_layer_activations_against_the_playbook_formula(s, b, h, a):
    # All bf16 (FSDP2's bf16 parameters), CUDA's fused RMSNorm. Korthikanti's 34 s*b*h: LayerNorm inputs 4, QKV
    # input 2, Q and K 4, V 2, attention-output projection input 2, its dropout mask 1, MLP input 2, GELU input 8,
    # GELU output 8, MLP dropout mask 1; and 5*a*s^2*b for the scores, their softmax and its dropout mask. This
    # model has no dropout (-2 s*b*h), and flash attention keeps no scores (-5 a s^2 b) but one fp32 log-sum-exp per
    # row and head (+4 a s b); RMSNorm keeps one fp32 rstd per row (+2 x 4 s b).
    cfg = P.ModelConfig(vocab_size=256, dim=h, n_layers=1, n_heads=a, max_seq_len=s)
    train = P.Training(seq_len=s, batch_size=b, precision="bf16-fsdp")
    ours = sum(P.layer_activations(cfg, train, tp=1).values())
    assert ours == _korthikanti(s, b, h, a) - 2 * s * b * h - 5 * a * s * s * b + 4 * a * s * b + 8 * s * b
    # With tp = t and sequence parallelism Korthikanti divides everything by t, keeping one shard of the gathered
    # inputs and gathering again in backward. DTensor keeps the gathered (whole) inputs of the q/k/v and w1
    # projections: 4 s*b*h that do not shrink, 28 s*b*h that do.
    for t in (2, 4, 8):
        ours_t = sum(P.layer_activations(cfg, train, tp=t).values())
        assert ours_t == pytest.approx(s * b * h * (28 / t + 4) + (4 * a * s * b + 8 * s * b) / t, rel=1e-12)


def _forward_bytes(cfg, precision, checkpointing, batch, seq):
    """The recipe's model with the recipe's apply_ac, one forward and loss as train.py computes them: (the bytes of
    the tensors made in that forward and still alive after it, the bytes autograd saved)."""
    from helpers.measure.activations import LiveTensorBytes, SavedActivations
    from scripts.train import parallelize as par

    torch.manual_seed(0)
    model = recipe_gpt(cfg)
    par.apply_ac(model, checkpointing)
    live, saved = LiveTensorBytes(), SavedActivations()
    with live, saved, torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16-autocast"):
        x, y = torch.randint(0, cfg.vocab_size, (batch, seq)), torch.randint(0, cfg.vocab_size, (batch, seq))
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        alive = live.current
    return alive, saved.bytes, loss


@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
@pytest.mark.parametrize("checkpointing", ["none", "full", "alternate", "selective"])
def test_activation_formula_is_what_a_forward_keeps(precision, checkpointing):
    # On the CPU (composite RMSNorm): after one forward and its loss, the tensors it made and that are still alive
    # are the plan's kept activations plus the loss and its scalar total weight (8 bytes): the blocks' saved
    # tensors (or the checkpoints' inputs, or selective checkpointing's saved matmul and attention outputs), the
    # head's, the ids and positions, and under autocast the bf16 weight copies its cache holds whatever the
    # checkpointing. Without checkpointing autograd saves exactly that (the casts included, the loss not).
    cfg = P.ModelConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, max_seq_len=32)
    train = P.Training(seq_len=32, batch_size=2, precision=precision, checkpointing=checkpointing,
                       fused_rms_norm=False)
    alive, saved, _ = _forward_bytes(cfg, precision, checkpointing, 2, 32)
    act = P.activations(cfg, train, P.Layout(), 0)
    assert alive == act["kept"] + 8
    if checkpointing == "none":
        assert saved == act["kept"] + 4
    else:
        assert act["recompute"] > 0


def test_pipeline_keeps_more_microbatches_on_early_stages():
    cfg = P.ModelConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, max_seq_len=64)
    train = P.Training(seq_len=64, batch_size=1, grad_accum=8)
    layout = P.Layout(pp=4)
    assert [P.activations(cfg, train, layout, r)["in_flight"] for r in range(4)] == [4, 3, 2, 1]


# ----------------------------------------------------------------------------------------------- communication

def test_communication_closed_forms():
    cfg = P.ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=64)
    psi = P.parameter_count(cfg)   # every dim 0 divides by 4: no padding
    train = P.Training(seq_len=64, batch_size=2, grad_accum=3)
    ddp = {r["kind"]: r for r in P.communication(cfg, train, P.Layout(dp_replicate=4))}
    assert ddp["all_reduce"]["buffer_bytes"] == 4 * psi and ddp["all_reduce"]["sent_bytes"] == 2 * 3 / 4 * 4 * psi
    fsdp = {r["kind"]: r for r in P.communication(cfg, train, P.Layout(dp_shard=4))}
    # three micro-batches, every group (2 blocks, the root) gathered in forward and again in backward, and its
    # gradients reduce-scattered once per micro-batch; the gradient norm's per-tensor norms all-reduced once
    assert fsdp["all_gather"]["buffer_bytes"] == 3 * 2 * 4 * psi and fsdp["all_gather"]["calls"] == 3 * 2 * 3
    assert fsdp["reduce_scatter"]["buffer_bytes"] == 3 * 4 * psi and fsdp["reduce_scatter"]["calls"] == 3 * 3
    assert fsdp["all_reduce"]["buffer_bytes"] == 4 * len(P.parameter_shapes(cfg))
    bf16 = {r["kind"]: r for r in P.communication(cfg, P.replace(train, precision="bf16-fsdp"), P.Layout(dp_shard=4))}
    assert bf16["all_gather"]["buffer_bytes"] == fsdp["all_gather"]["buffer_bytes"] / 2, "gathered in bf16"
    assert bf16["reduce_scatter"]["buffer_bytes"] == fsdp["reduce_scatter"]["buffer_bytes"], "reduced in fp32"
    pp = {r["kind"]: r for r in P.communication(cfg, train, P.Layout(pp=2), rank=0)}
    assert pp["send"]["buffer_bytes"] == 3 * 2 * 64 * 64 * 4   # one hidden-state message per micro-batch forward
    tp = [r for r in P.communication(cfg, train, P.Layout(tp=2)) if r["group"] == "tp"]
    tokens = 2 * 64
    gathered = {r["kind"]: r["buffer_bytes"] for r in tp if r["kind"] != "all_reduce"}
    # per micro-batch of fp32: 4 gathers in each of the 2 blocks, the token embedding's gradient and the output's
    # input (all tokens x dim), the position embedding's gradient (one sequence x dim); as many reduce-scatters
    assert gathered["all_gather"] == gathered["reduce_scatter"] == 3 * 4 * ((2 * 4 + 2) * tokens * 64 + 64 * 64)


# --------------------------------------------------------------------------------------- layouts and commands

def test_fitting_layouts_for_seven_billion_on_eight_80gb_gpus():
    cfg = P.ModelConfig(vocab_size=256, dim=4096, n_layers=32, n_heads=32, max_seq_len=4096)
    plans = P.fitting_layouts(cfg, 8, 80e9, P.DATASHEETS["H100-SXM-80GB"], seq_len=4096, global_batch=64)
    assert plans, "a 7B model trains on 8 x 80 GB"
    assert all(p.peak <= 0.9 * 80e9 and p.layout.world == 8 for p in plans)
    assert [p.time["seconds"] for p in plans] == sorted(p.time["seconds"] for p in plans)
    ddp = P.plan(cfg, P.Training(seq_len=4096, batch_size=1, grad_accum=8, precision="bf16-autocast"),
                 P.Layout(dp_replicate=8), ranks=[0])
    assert ddp.peak > 80e9, "plain DDP holds 16 bytes per parameter: over 100 GB, it cannot fit"
    assert all(p.layout.dp_shard > 1 or p.layout.tp * p.layout.pp > 1 for p in plans)
    cmd = plans[0].command()
    assert cmd.startswith("torchrun --standalone --nproc-per-node=8 scripts/train/train.py")
    assert f"--tp {plans[0].layout.tp}" in cmd and "--n-layers 32" in cmd and "--batch 64" in cmd


def test_bad_layouts_are_refused():
    cfg = P.ModelConfig(n_heads=12, n_layers=12)
    with pytest.raises(ValueError, match="tp=8"):
        P.plan(cfg, P.Training(), P.Layout(tp=8))
    with pytest.raises(ValueError, match="bf16-fsdp needs FSDP2"):
        P.plan(cfg, P.Training(precision="bf16-fsdp"), P.Layout(dp_replicate=2))
    with pytest.raises(ValueError, match="vocabulary"):
        P.torchrun_command(P.ModelConfig(vocab_size=32000), P.Training(), P.Layout())
    with pytest.raises(ValueError, match="pp=5"):
        P.plan(cfg, P.Training(grad_accum=5), P.Layout(pp=5))
    with pytest.raises(ValueError, match="micro-batches"):
        P.plan(cfg, P.Training(grad_accum=1), P.Layout(pp=2))
    with pytest.raises(ValueError, match="precision"):
        P.Training(precision="fp16")


# --------------------------------------------------------------------------------- real FSDP2 and DDP, 2 ranks

def _model_state_worker(cfg, warmup, train):
    """The recipe's model under the recipe's apply_fsdp and apply_ddp, trained as train.py trains it (FSDP2
    reduces every micro-batch, DDP once per step), gradients clipped by the recipe's clip_grad_norm_: the bytes of
    each rank's model state before the gradients are freed, and the collectives of one step."""
    import contextlib

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from helpers.measure.comm_log import CollectiveLog
    from helpers.measure.memory import allocated_state_bytes, model_state_bytes
    from scripts.train import parallelize as par

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    try:
        world, out = dist.get_world_size(), {}
        x = torch.randint(0, cfg.vocab_size, (train.batch_size, train.seq_len))

        def step(name, model, trained, opt):
            for i in range(train.grad_accum):
                sync = name == "fsdp" or i == train.grad_accum - 1
                with contextlib.nullcontext() if sync else trained.no_sync():
                    F.cross_entropy(trained(x).flatten(0, 1), x.flatten()).backward()
            par.clip_grad_norm_(model.parameters(), 1.0)
            state = {"held": model_state_bytes(model, opt), "allocated": allocated_state_bytes(model, opt)}
            opt.step()
            opt.zero_grad(set_to_none=True)
            return state

        for name in ("fsdp", "ddp"):
            torch.manual_seed(0)
            model = recipe_gpt(cfg)
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
            if name == "fsdp":
                par.apply_fsdp(model, mesh)
                trained = model
            else:
                trained = par.apply_ddp(model, mesh, torch.device("cpu"))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for _ in range(warmup):   # DDP rebuilds its buckets after the first step; AdamW makes its state
                step(name, model, trained, opt)
            log = CollectiveLog()
            with log:
                state = step(name, model, trained, opt)
            out[name] = {**state, "log": log.summary()}
        return out
    finally:
        import gc

        gc.collect()
        dist.destroy_process_group()


def test_model_state_and_collectives_match_fsdp2_and_ddp_on_two_ranks():
    import helpers

    cfg = P.ModelConfig(vocab_size=7, dim=8, n_layers=2, n_heads=2, max_seq_len=5)  # 7 and 5 rows: padding
    train = P.Training(seq_len=5, batch_size=2, grad_accum=2)
    results = helpers.launch(_model_state_worker, cfg, 2, train, world_size=2, timeout=180, quiet=True)
    for rank, r in enumerate(results):
        fsdp = P.model_state(cfg, train, P.Layout(dp_shard=2), rank)
        assert r["fsdp"]["held"] == fsdp["held"], f"rank {rank}: local shards, grads, AdamW moments"
        assert r["fsdp"]["allocated"] == fsdp["allocated"], f"rank {rank}: padded storages"
        ddp = P.model_state(cfg, train, P.Layout(dp_replicate=2), rank)
        assert r["ddp"]["held"] == ddp["held"]
        for name, layout in (("fsdp", P.Layout(dp_shard=2)), ("ddp", P.Layout(dp_replicate=2))):
            planned = {}
            for c in P.communication(cfg, train, layout, rank):
                entry = planned.setdefault(c["kind"], {"calls": 0, "bytes": 0})
                entry["calls"] += c["calls"]
                entry["bytes"] += c["buffer_bytes"]
            logged = {kind: {"calls": v["calls"], "bytes": v["bytes"]} for kind, v in r[name]["log"].items()}
            assert logged == planned, f"{name}, rank {rank}: collectives of one step (calls and bytes per kind)"
    assert results[0]["fsdp"]["held"] != results[1]["fsdp"]["held"], "7 and 5 rows split unevenly"
