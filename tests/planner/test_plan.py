"""The planner (scripts/train/plan.py) against hand-worked cases, published formulas, real runs on CPU ranks and
torchtitan's published runs.

Hand-worked: FSDP2's padded shards of a small Llama, row by row. Published: ZeRO's 16 bytes per parameter for
mixed-precision Adam (16Ψ/N fully sharded), the Ultra-Scale Playbook's table of model-state memory, the per-layer
activation formula of Korthikanti et al. (2022) that the Playbook uses, with the terms that do not apply to a Llama
(dropout masks, stored s^2 scores, a GELU MLP) exchanged one by one, and every row of torchtitan's published
performance tables (the rows notebook 10 shows, held to the same goal). Real: the parameter count of the model, the
bytes a forward keeps under every checkpointing policy (torchtitan's per-op one included), the three fp32 tensors of
the vocabulary the loss's backward holds, and the bytes of parameters, gradients, AdamW state and collectives that
FSDP2 and DDP hold and send on two gloo ranks. And the command line: its help, its one-line refusals (exit status 2),
and a `torchrun` line the recipe's own argument check accepts.
"""
from __future__ import annotations

import functools
import math
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from helpers.measure import published_runs
from helpers.paths import SCRIPTS

sys.path.insert(0, str(SCRIPTS / "train"))
import plan as P  # noqa: E402
from config import LlamaArgs, preset  # noqa: E402

SMALL = LlamaArgs(vocab_size=7, dim=4, n_layers=1, n_heads=2, n_kv_heads=1, multiple_of=4, max_seq_len=5)
TINY = LlamaArgs(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=64)


def recipe_model(cfg: LlamaArgs):
    from model import Llama

    return Llama(cfg)


# ---------------------------------------------------------------------------------------------- parameter count

@pytest.mark.parametrize("cfg", [SMALL, TINY, LlamaArgs(vocab_size=97, dim=64, n_layers=2, n_heads=4,
                                                         tie_embeddings=True),
                                 *(preset(name) for name in ("llama2-7b", "llama3-8b"))])
def test_parameter_count_and_shapes_are_the_models(cfg):
    built = P.count_parameters(lambda: recipe_model(cfg))
    assert P.parameter_count(cfg) == built == cfg.num_params()
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in recipe_model(cfg).named_parameters()}
    assert shapes == {n: s for n, s, _ in P.parameter_shapes(cfg)}, "the planner knows every parameter's shape"


def test_presets_have_the_released_sizes():
    counts = {name: P.parameter_count(preset(name)) / 1e9 for name in ("llama2-7b", "llama3-8b", "llama3-70b",
                                                                         "llama3-405b")}
    assert [round(c, 2) for c in counts.values()] == [6.74, 8.03, 70.55, 405.85]


# ------------------------------------------------------------------------------------------------- model state

def test_fsdp_padding_worked_by_hand():
    # SMALL on dp_shard = 2 (head_dim 2, one key/value head, hidden 12): dim-0 rows per parameter, rank 0 | rank 1
    # (torch.chunk: ceil first, the rest after): tok (7,4): 4|3, norms (4,): 2|2 (x3), wq, wo (4,4): 2|2,
    # wk, wv (2,4): 1|1, w1, w3 (12,4): 6|6, w2 (4,12): 2|2, output (7,4): 4|3. Elements: rank 0 16 + 6 + 8 + 8 + 4 +
    # 4 + 48 + 24 + 16 = 134; rank 1 12 + 6 + 8 + 8 + 4 + 4 + 48 + 24 + 12 = 126. Both allocate rank 0's padded 134;
    # together they hold all 260 parameters.
    layout, train = P.Layout(dp_shard=2), P.Training(seq_len=5, batch_size=1)
    r0, r1 = (P.model_state(SMALL, train, layout, r) for r in (0, 1))
    assert (r0["elements"], r1["elements"], r1["padded_elements"]) == (134, 126, 134)
    assert r0["elements"] + r1["elements"] == P.parameter_count(SMALL) == 260
    assert r1["held"] == {"parameters": 126 * 4, "gradients": 126 * 4, "optimizer": 126 * 8}
    assert r1["allocated"] == {"parameters": 134 * 4, "gradients": 134 * 4, "optimizer": 126 * 8}


@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast", "bf16-fsdp"])
def test_zero_sixteen_bytes_per_parameter_and_sixteen_psi_over_n(precision):
    # ZeRO (Rajbhandari et al. 2020): mixed-precision Adam holds 2Ψ + 2Ψ + 12Ψ = 16Ψ bytes; fully sharded over N
    # ranks (stage 3) 16Ψ/N each. FSDP2's split of the 16 differs (fp32 master weights and fp32 gradients, 4 + 4 +
    # 8, the bf16 copy only while gathered) but the sum is ZeRO's. Every dim 0 of TINY divides by 4 and 8.
    psi = P.parameter_count(TINY)
    train = P.Training(seq_len=64, batch_size=1, precision=precision)
    assert sum(P.model_state(TINY, train, P.Layout(), 0)["held"].values()) == 16 * psi
    sgd = P.model_state(TINY, P.replace(train, optimizer="sgd"), P.Layout(), 0)["held"]
    assert sgd["optimizer"] == 4 * psi, "SGD with momentum: one fp32 buffer, 12 bytes per parameter in all"
    for n in (4, 8):
        for rank in range(n):
            state = P.model_state(TINY, train, P.Layout(dp_shard=n), rank)
            assert sum(state["held"].values()) == sum(state["allocated"].values()) == 16 * psi / n
    # ZeRO's figure: a 7.5B-parameter model needs 120 GB of model state, 1.875 GB per rank at N = 64.
    assert 16 * 7.5e9 / 1e9 == 120 and 16 * 7.5e9 / 64 / 1e9 == 1.875


def test_playbook_model_state_table():
    # The Ultra-Scale Playbook tabulates model-state memory with Adam in mixed precision (bf16 parameters and
    # gradients plus fp32 master weights and two moments) at 2 + 2 + 4 + 8 = 16 bytes per parameter: 112 GB for
    # 7B. Llama 2 7B has 6.74B parameters, so the planner's one-rank total is the table's 112 GB scaled by the count.
    cfg = preset("llama2-7b")
    psi = P.parameter_count(cfg)
    held = P.model_state(cfg, P.Training(seq_len=4096, batch_size=1, precision="bf16-fsdp"), P.Layout(), 0)["held"]
    assert sum(held.values()) == pytest.approx(112e9 * psi / 7e9, rel=1e-12)
    assert 6.5e9 < psi < 7e9


def test_tensor_parallel_splits_the_projections_and_fsdp_splits_what_is_left():
    train = P.Training(seq_len=64, batch_size=1)
    tp2 = P.model_state(TINY, train, P.Layout(tp=2), 0)["elements"]
    # the norms stay whole; the embedding, projections (grouped-query wk and wv too) and output are halved
    replicated = sum(math.prod(s) for _, s, d in P.parameter_shapes(TINY) if d is None)
    assert tp2 == replicated + (P.parameter_count(TINY) - replicated) // 2
    fsdp_tp = [P.model_state(TINY, train, P.Layout(dp_shard=2, tp=2), r)["elements"] for r in range(4)]
    assert sum(fsdp_tp) == 2 * tp2 and fsdp_tp[0] == fsdp_tp[1] == tp2 / 2   # tp fastest: ranks 0, 1 differ in tp


def test_pipeline_stages_split_the_layers_as_torchtitan_does():
    cfg = P.replace(TINY, n_layers=4)
    layout = P.Layout(pp=2)
    train = P.Training(seq_len=64, batch_size=1, grad_accum=2)
    first, last = (P.model_state(cfg, train, layout, r)["elements"] for r in (0, 1))
    assert first + last == P.parameter_count(cfg)
    assert first - last == -64, "the embedding beside two blocks, two blocks beside the final norm and the output"
    names = [n for n, _, _ in P.stage_parameters(cfg, layout, 1)]
    assert names[0] == "layers.2.attention_norm.weight" and names[-1] == "output.weight"
    # Llama 3 405B's 126 layers over 8 stages: the embedding and the output count as a layer each, the first stages
    # take the remainder: 15 blocks on the first stage, 16 on the next six, 15 on the last
    big = preset("llama3-405b")
    blocks = [sum(n.endswith("attention_norm.weight") for n, _, _ in P.stage_parameters(big, P.Layout(pp=8), s))
              for s in range(8)]
    assert blocks == [15, 16, 16, 16, 16, 16, 16, 15]


# ------------------------------------------------------------------------------------------------- activations

def _korthikanti(s, b, h, a, t=1):
    """Korthikanti et al. (2022), eq. for tensor + sequence parallelism, bytes per layer in 16-bit: the formula
    the Ultra-Scale Playbook quotes (with t = 1): s*b*h*(34/t + 5*a*s/(h*t))."""
    return s * b * h * (34 / t + 5 * a * s / (h * t))


@pytest.mark.parametrize("s,b,h,a", [(2048, 1, 4096, 32), (1024, 8, 768, 12)])
def test_layer_activations_against_the_playbook_formula(s, b, h, a):
    # All bf16 (FSDP2's bf16 parameters), CUDA's fused RMSNorm, multi-head attention. Korthikanti's 34 s*b*h:
    # LayerNorm inputs 4, QKV input 2, Q and K 4, V 2, attention-output projection input 2, its dropout mask 1, MLP
    # input 2, GELU input 8, GELU output 8, MLP dropout mask 1; and 5*a*s^2*b for the scores, their softmax and its
    # dropout mask. A Llama has no dropout (-2 s*b*h), flash attention keeps no scores (-5 a s^2 b) but one fp32
    # log-sum-exp per row and head (+4 a s b), RMSNorm keeps one fp32 rstd per row (+2 x 4 s b), and SwiGLU keeps
    # four tensors of its hidden width (w1's and w3's outputs, silu's, the product) where the GELU MLP kept two of
    # 4h (-16 s*b*h, +8 s*b*hidden). Rotary positions keep nothing new per block (cos and sin are buffers).
    cfg = LlamaArgs(vocab_size=256, dim=h, n_layers=1, n_heads=a, max_seq_len=s)
    train = P.Training(seq_len=s, batch_size=b, precision="bf16-fsdp")
    ours = sum(P.layer_activations(cfg, train, tp=1).values())
    assert ours == _korthikanti(s, b, h, a) - 2 * s * b * h - 5 * a * s * s * b + 4 * a * s * b + 8 * s * b \
        - 16 * s * b * h + 8 * s * b * cfg.hidden
    # With tp = t and sequence parallelism Korthikanti divides everything by t, keeping one shard of the gathered
    # inputs and gathering again in backward. DTensor keeps the gathered (whole) inputs of the wq/wk/wv and w1/w3
    # projections: 4 s*b*h that do not shrink; the rest does.
    for t in (2, 4, 8):
        ours_t = sum(P.layer_activations(cfg, train, tp=t).values())
        rest = ours - 4 * s * b * h
        assert ours_t == pytest.approx(4 * s * b * h + rest / t, rel=1e-12)


def _torchtitan_selective_context():
    """torchtitan's per-op policy (`_save_list` and `_custom_policy` in torchtitan/parallelisms/parallelize_llama.py
    at 9dec370; today torchtitan/distributed/activation_checkpoint.py): save matmul and attention outputs (and a
    reduce-scatter's), except every second matmul of a block."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    save = {aten.mm.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_flash_attention.default}
    meta = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == aten.mm.default:
            meta[mode] += 1
        keep = func in save and not (func == aten.mm.default and meta[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


def _forward_bytes(cfg, precision, checkpointing, batch, seq):
    """The recipe's model with the recipe's apply_ac (or torchtitan's per-op policy, wrapped the same way), one
    forward and loss as train.py computes them: (the bytes of the tensors made in that forward and still alive after
    it, the bytes autograd saved)."""
    from ac import apply_ac
    from helpers.measure.activations import LiveTensorBytes, SavedActivations
    from model import cross_entropy
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = recipe_model(cfg)
    model.init_weights()
    if checkpointing == P.TORCHTITAN_SELECTIVE:
        for block in model.layers.values():
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False,
                                              context_fn=_torchtitan_selective_context)
    else:
        apply_ac(model, checkpointing)
    live, saved = LiveTensorBytes(), SavedActivations()
    with live, saved, torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16-autocast"):
        x, y = torch.randint(0, cfg.vocab_size, (batch, seq)), torch.randint(0, cfg.vocab_size, (batch, seq))
        loss = cross_entropy(model(x), y)
        alive = live.current
    return alive, saved.bytes, loss


@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
@pytest.mark.parametrize("checkpointing", ["none", "full", "alternate", "selective", P.TORCHTITAN_SELECTIVE])
def test_activation_formula_is_what_a_forward_keeps(precision, checkpointing):
    # On the CPU (composite RMSNorm): after one forward and its loss, the tensors it made and that are still alive
    # are the plan's kept activations plus the loss (fp32, 4 bytes) and the count of targets its mean divides by
    # (int64, 8): the blocks' saved tensors (or the checkpoints' inputs, or a selective policy's saved outputs), the
    # head's, the token ids, and under autocast the bf16 weight copies its cache holds whatever the checkpointing.
    # Without checkpointing autograd saves exactly that (the casts included, the loss not, the count for the
    # division's backward) and the rotary tables' storage (a buffer).
    cfg = P.replace(TINY, n_layers=4, max_seq_len=32)
    train = P.Training(seq_len=32, batch_size=2, precision=precision, checkpointing=checkpointing,
                       fused_rms_norm=False)
    alive, saved, _ = _forward_bytes(cfg, precision, checkpointing, 2, 32)
    act = P.activations(cfg, train, P.Layout(), 0)
    assert alive == act["kept"] + 4 + 8
    if checkpointing == "none":
        assert saved == act["kept"] + act["buffers_saved"] + 8
    else:
        assert act["recompute"] > 0


def test_the_loss_backward_holds_three_vocabulary_sized_fp32_tensors():
    # Eager cross-entropy on fp32 logits: log_softmax keeps its output; its backward receives nll_loss's gradient
    # (as large) and makes the logits' gradient (as large) while both are alive: three at once, the planner's
    # "loss's backward" phase (the log-probabilities in the kept activations, two more beside them).
    from helpers.measure.activations import LiveTensorBytes

    n, v = 64, 1000
    logits, targets = torch.randn(n, v, requires_grad=True), torch.randint(0, v, (n,))
    live = LiveTensorBytes()
    with live:
        F.cross_entropy(logits, targets).backward()
    assert 3 * n * v * 4 <= live.peak < 3 * n * v * 4 + 4096
    cfg, layout = P.replace(TINY, vocab_size=v), P.Layout()
    train = P.Training(seq_len=32, batch_size=2)
    memory = P.memory(cfg, train, layout, 0)
    assert memory["phases"]["the loss's backward"] - P.activations(cfg, train, layout, 0)["kept"] == 2 * 64 * v * 4


def test_pipeline_keeps_more_microbatches_on_early_stages():
    cfg = P.replace(TINY, n_layers=4)
    train = P.Training(seq_len=64, batch_size=1, grad_accum=8)
    layout = P.Layout(pp=4)
    assert [P.activations(cfg, train, layout, r)["in_flight"] for r in range(4)] == [4, 3, 2, 1]


def test_compiled_selective_checkpointing_keeps_only_what_a_backward_reads():
    # eager per-op checkpointing keeps every output its policy names, wo's and w2's too (read by no backward: they
    # feed the residual adds); a compiled block's partitioner keeps only what the backward needs
    n, d = 2 * 64, TINY.dim
    for policy, unread in (("selective", 2 * n * d * 4), (P.TORCHTITAN_SELECTIVE, n * d * 4)):
        eager = P.Training(seq_len=64, batch_size=2, checkpointing=policy)
        compiled = P.replace(eager, compile=True)
        gap = sum(P.selective_block(TINY, eager, 1).values()) - sum(P.selective_block(TINY, compiled, 1).values())
        assert gap == unread


# -------------------------------------------------------------------------------------------- memory and time

def test_reserved_is_allocated_times_the_published_overhead():
    # torchtitan PR #165: 52.13 % active, 62.51 % reserved (selective); 23.92 %, 32.64 % (full)
    assert P.allocator_overhead("selective") == pytest.approx(62.51 / 52.13 - 1)
    assert P.allocator_overhead("full") == pytest.approx(32.64 / 23.92 - 1)
    m = P.memory(TINY, P.Training(seq_len=64, batch_size=2, checkpointing="full"), P.Layout(), 0)
    assert m["reserved"] == pytest.approx(m["allocated"] * 32.64 / 23.92)


def test_fsdp_times_tp_at_two_is_not_fsdp_alone_at_twice_the_batch():
    # 8 GPUs, 8 sequences per step: FSDP 4 x TP 2 gives each tp pair 2 sequences, FSDP 8 one per GPU. The FLOPs
    # per GPU are the same; tensor parallelism's narrower matmuls and its exposed traffic make its step longer.
    cfg = preset("llama3-8b", max_seq_len=8192)
    rates = P.gpu_rates(P.GPUS["H100-80GB"])
    times = {}
    for layout, micro in ((P.Layout(dp_shard=4, tp=2), 2), (P.Layout(dp_shard=8), 1)):
        train = P.Training(seq_len=8192, batch_size=micro, precision="bf16-fsdp", checkpointing="full")
        times[layout.tp] = P.step_time(cfg, train, layout, rates)
    assert times[2]["seconds"] > times[1]["seconds"]
    assert times[2]["comm_exposed"] > 10 * times[1]["comm_exposed"]


# ----------------------------------------------------------------------------------------------- communication

def test_communication_closed_forms():
    psi = P.parameter_count(TINY)   # every dim 0 divides by 4: no padding
    train = P.Training(seq_len=64, batch_size=2, grad_accum=3)
    ddp = {r["kind"]: r for r in P.communication(TINY, train, P.Layout(dp_replicate=4))}
    assert ddp["all_reduce"]["buffer_bytes"] == 4 * psi and ddp["all_reduce"]["sent_bytes"] == 2 * 3 / 4 * 4 * psi
    fsdp = {r["kind"]: r for r in P.communication(TINY, train, P.Layout(dp_shard=4))}
    # three micro-batches, every group (2 blocks, the root) gathered in forward and again in backward, and its
    # gradients reduce-scattered once per micro-batch; the gradient norm's per-tensor norms all-reduced once
    assert fsdp["all_gather"]["buffer_bytes"] == 3 * 2 * 4 * psi and fsdp["all_gather"]["calls"] == 3 * 2 * 3
    assert fsdp["reduce_scatter"]["buffer_bytes"] == 3 * 4 * psi and fsdp["reduce_scatter"]["calls"] == 3 * 3
    assert fsdp["all_reduce"]["buffer_bytes"] == 4 * len(P.parameter_shapes(TINY))
    bf16 = {r["kind"]: r for r in P.communication(TINY, P.replace(train, precision="bf16-fsdp"), P.Layout(dp_shard=4))}
    assert bf16["all_gather"]["buffer_bytes"] == fsdp["all_gather"]["buffer_bytes"] / 2, "gathered in bf16"
    assert bf16["reduce_scatter"]["buffer_bytes"] == fsdp["reduce_scatter"]["buffer_bytes"], "reduced in fp32"
    pp = {r["kind"]: r for r in P.communication(TINY, train, P.Layout(pp=2), rank=0)}
    assert pp["send"]["buffer_bytes"] == 3 * 2 * 64 * 64 * 4   # one hidden-state message per micro-batch forward
    tokens = 2 * 64
    for ac, again in (("none", 0), ("full", 2 * 2), (P.TORCHTITAN_SELECTIVE, 2 * 2)):
        records = P.communication(TINY, P.replace(train, checkpointing=ac), P.Layout(tp=2))
        tp = [r for r in records if r["group"] == "tp"]
        moved = {k: sum(r["buffer_bytes"] for r in tp if r["kind"] == k) for k in ("all_gather", "reduce_scatter")}
        # per micro-batch of fp32: 4 gathers in each of the 2 blocks, the embedding's gradient and the output's
        # input (all tokens x dim); as many reduce-scatters; a recomputed block gathers both halves' inputs again,
        # and scatters both outputs again unless its policy kept them (torchtitan's does)
        scattered_again = 0 if ac == P.TORCHTITAN_SELECTIVE else again
        assert moved["all_gather"] == 3 * 4 * (2 * 4 + 2 + again) * tokens * 64
        assert moved["reduce_scatter"] == 3 * 4 * (2 * 4 + 2 + scattered_again) * tokens * 64


# --------------------------------------------------------------------------------------- layouts and commands

def test_fitting_layouts_for_llama3_8b_on_eight_80gb_gpus():
    cfg = preset("llama3-8b", max_seq_len=4096)
    plans = P.fitting_layouts(cfg, 8, "H100-80GB", seq_len=4096, global_batch=16)
    usable = P.GPUS["H100-80GB"].memory - P.NON_TORCH_BYTES
    assert plans and all(p.reserved <= usable and p.layout.world == 8 for p in plans)
    assert [p.time["seconds"] for p in plans] == sorted(p.time["seconds"] for p in plans)
    ddp = P.plan(cfg, P.Training(seq_len=4096, batch_size=1, grad_accum=2, precision="bf16-autocast"),
                 P.Layout(dp_replicate=8), ranks=[0])
    assert ddp.reserved > usable, "plain DDP holds 16 bytes per parameter: over 120 GB, it cannot fit"
    assert all(p.layout.dp_shard > 1 or p.layout.tp * p.layout.pp > 1 for p in plans), "every fit shards the model"
    cmd = plans[0].command()
    assert cmd.startswith("torchrun --standalone --nproc-per-node=8 scripts/train/train.py --model llama3-8b")
    assert f"--tp {plans[0].layout.tp}" in cmd and "--seq-len 4096" in cmd and "--batch 16" in cmd


def test_bad_layouts_are_refused():
    cfg = preset("small")
    with pytest.raises(ValueError, match="tp 8 must divide"):
        P.plan(cfg, P.Training(seq_len=1024), P.Layout(tp=8))
    with pytest.raises(ValueError, match="bf16-fsdp needs FSDP2"):
        P.plan(cfg, P.Training(seq_len=1024, precision="bf16-fsdp"), P.Layout(dp_replicate=2))
    with pytest.raises(ValueError, match="stages need at least as many layers"):
        P.plan(cfg, P.Training(seq_len=1024, grad_accum=16), P.Layout(pp=13))
    with pytest.raises(ValueError, match="micro-batches"):
        P.plan(cfg, P.Training(seq_len=1024, grad_accum=1), P.Layout(pp=2))
    with pytest.raises(ValueError, match="precision"):
        P.Training(precision="fp16")
    with pytest.raises(ValueError, match="--ac"):
        P.torchrun_command(cfg, P.Training(seq_len=1024, checkpointing=P.TORCHTITAN_SELECTIVE), P.Layout())
    with pytest.raises(ValueError, match="--init-from"):
        P.torchrun_command(P.replace(cfg, ffn_hidden=1000), P.Training(seq_len=1024), P.Layout())


def _cli(*argv):
    return subprocess.run([sys.executable, str(SCRIPTS / "train" / "plan.py"), *argv], capture_output=True,
                          text=True, timeout=120)


def test_the_command_line_prints_help():
    out = _cli("--help")
    assert out.returncode == 0 and "usage: plan.py" in out.stdout and "--gpus" in out.stdout


@pytest.mark.parametrize("argv,says", [
    (("--model", "llama3-8b", "--gpus", "8", "--gpu", "B200"), "invalid choice: 'B200'"),
    (("--model", "llama3-8b", "--gpus", "8", "--tp", "3"), "tp 3 must divide"),
    (("--model", "llama3-8b", "--gpus", "8", "--tp", "4", "--pp", "4"), "do not divide --gpus 8"),
    (("--model", "llama3-8b", "--gpus", "8", "--batch", "7", "--micro-batch", "2"), "--batch 7 does not split"),
    (("--model", "llama3-8b", "--gpus", "8", "--cp", "2", "--tp", "2"), "--cp with --tp or --pp"),
    (("--model", "llama3-8b", "--gpus", "8", "--cp", "2", "--compile"), "add --no-compile"),
    (("--model", "llama3-8b", "--gpus", "8", "--moe-experts", "6", "--ep", "4"), "must divide both"),
    (("--model", "llama3-8b", "--gpus", "8", "--cp", "3", "--seq-len", "12288"), "divide no --dp-shard"),
    (("--model", "llama3-8b", "--gpus", "8", "--gpu", "A100-80GB", "--float8", "tensorwise"), "A100-80GB has none"),
    (("--model", "llama3-8b", "--gpus", "8", "--float8", "tensorwise", "--dtype", "fp32"), "--float8 trains in bf16"),
    (("--model", "llama3-8b", "--gpus", "8", "--pp", "4", "--pp-schedule", "zbv"), "invalid choice: 'zbv'"),
    (("--model", "llama3-8b", "--gpus", "8", "--calibrate", "no_such_log"), "--calibrate no_such_log: "),
    (("--gpus", "8",), "give --model"),
    (("--init-from", "no_such_folder", "--gpus", "8"), "--init-from no_such_folder: "),
    (("--model", "llama3-8b", "--gpus", "0"), "--gpus must be at least 1"),
])
def test_bad_input_gets_one_line_and_exit_status_2(argv, says):
    out = _cli(*argv)
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and says in out.stderr, out.stderr


def test_llama3_70b_on_256_h100s_prints_layouts_and_a_line_the_recipe_accepts(monkeypatch):
    out = _cli("--model", "llama3-70b", "--gpus", "256", "--gpu", "H100-80GB", "--seq-len", "8192")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any("layouts fit" in line for line in lines) and "MFU" in out.stdout and "reserved" in out.stdout
    command = next(line for line in lines if line.startswith("$ torchrun"))
    assert "--nnodes=32 --nproc-per-node=8" in command
    flags = command.split("scripts/train/train.py", 1)[1].split()
    import train as recipe

    monkeypatch.setenv("WORLD_SIZE", "256")
    monkeypatch.setattr(recipe, "uses_gpu", lambda: False)    # the flags are checked alike on any machine
    args = recipe.parse_args(flags)              # exits with status 2 on any flag the recipe refuses
    assert args.model_config == preset("llama3-70b", max_seq_len=8192)
    assert args.dims.world == 256 and args.batch == 256 and args.seq_len == 8192


# ----------------------------------------------------------------------------------------------- published runs

PREDICTIONS = {id(row): published_runs.predict(P, row) for row in published_runs.ROWS}


@pytest.mark.parametrize("row", published_runs.ROWS, ids=lambda r: f"{r['table']}: {r['label']}")
def test_published_run(row):
    got = PREDICTIONS[id(row)]
    for kind in ("memory", "tokens"):
        if f"{kind}_ratio" in got and not (kind == "tokens" and published_runs.calibrates(P, row)):
            within = abs(got[f"{kind}_ratio"] - 1) <= published_runs.GOAL[kind]
            assert within != ((row["table"], row["label"], kind) in published_runs.MISSES), (kind, got)
    if published_runs.calibrates(P, row):
        assert got["tokens_ratio"] == pytest.approx(1, rel=1e-4), "the run the 500 W rate is solved from"


def test_one_published_row_calibrates_and_every_other_figure_counts():
    rows = published_runs.ROWS
    stats = published_runs.summary(P, rows, [PREDICTIONS[id(r)] for r in rows])
    assert len(rows) == 29 and sum(published_runs.calibrates(P, r) for r in rows) == 1
    assert stats["tokens"]["rows"] == 28 and stats["memory"]["rows"] == sum(bool(r["memory_gib"]) for r in rows) == 18
    for kind in ("memory", "tokens"):
        assert len(stats[kind]["missed"]) <= 1, (kind, stats[kind])
    missed = {m for kind in stats for m in stats[kind]["missed"]}
    assert missed == set(published_runs.MISSES), "each miss has its reason"
    assert not published_runs.predict(P, published_runs.OOM_ROW)["fits"], "the published out-of-memory run"


def test_the_500w_rate_is_solved_from_its_run_and_is_below_the_datasheet():
    # The planner's rate for the 500 W H100s is the one at which it predicts its calibration run; with the same
    # datasheet and a 700 W clock (the H100-80GB row, the same SMs and links) it predicts that run faster.
    run = P.GPUS["H100-96GB-500W"].calibration
    rates = P.gpu_rates(P.GPUS["H100-96GB-500W"])
    assert P.tokens_per_gpu(run.cfg, run.train, run.layout, rates) == pytest.approx(run.tokens_per_s, rel=1e-5)
    full_clock = P.gpu_rates(P.replace(P.GPUS["H100-96GB-500W"], calibration=None))
    assert rates.matmul < full_clock.matmul
    assert rates.float8 / rates.matmul == pytest.approx(full_clock.float8 / full_clock.matmul)
    assert rates.memory == full_clock.memory and rates.intra == full_clock.intra, "only the compute rates move"


# --------------------------------------------------------------------------------- real FSDP2 and DDP, 2 ranks

def _model_state_worker(cfg, warmup, train, scripts):
    """The recipe's model under the recipe's apply_fsdp and apply_ddp, trained as train.py trains it (FSDP2
    reduces every micro-batch, DDP once per step), gradients clipped by the recipe's clip_grad_norm_: the bytes of
    each rank's model state before the gradients are freed, and the collectives of one step."""
    import contextlib
    import sys

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, scripts)
    import parallelize as par
    from helpers.measure.comm_log import CollectiveLog
    from helpers.measure.memory import allocated_state_bytes, model_state_bytes
    from model import Llama

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
            model = Llama(cfg)
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

    cfg = LlamaArgs(vocab_size=7, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, multiple_of=4, max_seq_len=5)
    train = P.Training(seq_len=5, batch_size=2, grad_accum=2)  # 7 vocabulary rows and 1 x 4 key/value rows: padding
    results = helpers.launch(_model_state_worker, cfg, 2, train, str(SCRIPTS / "train"), world_size=2, timeout=600,
                             quiet=True)  # 15 s on a loaded 2-core machine
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
    assert results[0]["fsdp"]["held"] != results[1]["fsdp"]["held"], "7 rows split unevenly"
