"""The planner's float8 and async TP (scripts/train/plan.py), held against hand counts of a small Llama.

float8 as torchao converts a model (`convert_to_float8_training`, its module filter leaving the output head out):
every block's linear layers run their three matmuls at the float8 rate; under FSDP2 with tensorwise scaling their
weights are all-gathered in 1 byte each (FSDP2's float8 all-gather) and their scales all-reduced once a step; under
tensor parallelism a block's all-gathers carry float8. Async TP overlaps the blocks' TP collectives with their
matmuls. And the command line: the plan's torchrun line says what the recipe does not build.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from helpers.paths import SCRIPTS

sys.path.insert(0, str(SCRIPTS / "train"))
import plan as P  # noqa: E402
from config import LlamaArgs  # noqa: E402

TINY = LlamaArgs(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=64)
D, H, KV, V, L = TINY.dim, TINY.hidden, TINY.n_kv_heads * TINY.head_dim, TINY.vocab_size, TINY.n_layers
LINEAR = 2 * D * D + 2 * D * KV + 3 * D * H            # a block's projections: wq, wo; wk, wv; w1, w3, w2
OTHER = 2 * V * D + (2 * L + 1) * D                     # embedding, output, the norms
FAST = dict(attention=float("inf"), memory=float("inf"), intra=float("inf"), inter=float("inf"), latency=0.0)


def test_float8_converts_every_blocks_linear_layers_and_nothing_else():
    train = P.Training(float8="tensorwise")
    converted = [name for name, _, _ in P.parameter_shapes(TINY) if P.float8_converted(name, TINY, train, 1)]
    assert len(converted) == 7 * L and not any(n.startswith(("tok_", "output", "norm")) for n in converted)
    assert sum(s[0] * s[1] for n, s, _ in P.parameter_shapes(TINY) if n in converted) == L * LINEAR
    assert not any(P.float8_converted(n, TINY, P.Training(), 1) for n, _, _ in P.parameter_shapes(TINY))


def test_float8_leaves_out_the_linears_whose_piece_on_a_rank_float8_matmuls_refuse():
    # TINY's key/value projections are 32 x 64: under tp 4 a rank's piece has 8 rows, not a multiple of 16, so the
    # recipe (float8.py) keeps wk and wv in bf16; the plan runs them at the bf16 rate and gathers them in 2 bytes
    train = P.Training(seq_len=64, batch_size=2, precision="bf16-fsdp", float8="tensorwise")
    kept = {name.split(".")[-2] for name, _, _ in P.parameter_shapes(TINY)
            if name.split(".")[-2] in ("wq", "wk", "wv", "wo", "w1", "w3", "w2")
            and not P.float8_converted(name, TINY, train, 4)}
    assert kept == {"wk", "wv"}
    assert P.float8_block_linears(TINY, train, 4) == {"wq", "wo", "w1", "w3", "w2"}
    rates = P.Rates(matmul=1e12, float8=2e12, **FAST)
    step = P.step_time(TINY, P.replace(train, precision="bf16-autocast"), P.Layout(tp=4), rates)
    tokens = 2 * 64
    blocks = (L * (LINEAR - 2 * D * KV) / 2e12 + L * 2 * D * KV / 1e12) / 4
    assert step["matmul"] == pytest.approx(6 * tokens * (blocks + V * D / 4 / 1e12))


@pytest.mark.parametrize("scaling,width", [("tensorwise", 1), ("rowwise", 2)])
def test_fsdp_gathers_float8_weights_in_one_byte_under_tensorwise_scaling(scaling, width):
    # dp_shard 4 divides every dim 0 of TINY: no padding. Per micro-batch every group is gathered in forward and
    # again in backward; gradients are reduced in fp32 whatever the compute dtype
    train = P.Training(seq_len=64, batch_size=1, grad_accum=3, precision="bf16-fsdp", float8=scaling)
    records = {r["what"]: r for r in P.communication(TINY, train, P.Layout(dp_shard=4))}
    assert records["FSDP parameters"]["buffer_bytes"] == 3 * 2 * (L * LINEAR * width + OTHER * 2)
    assert records["FSDP gradients"]["buffer_bytes"] == 3 * 4 * (L * LINEAR + OTHER)
    scales = records.get("float8 weight scales (amax)")
    assert (scales["buffer_bytes"] == 7 * L * 4) if scaling == "tensorwise" else scales is None


def test_a_blocks_tensor_parallel_gathers_carry_float8():
    # per micro-batch (2 x 64 tokens) each block gathers its attention and feed-forward inputs in forward and the
    # row-wise layers' output gradients in backward: 4 x tokens x dim, in 1 byte under float8 (2 in bf16); the
    # embedding's gradient and the output's input are gathered in bf16 either way; reduce-scatters stay bf16
    tokens, layout = 2 * 64, P.Layout(dp_shard=2, tp=2)
    for float8, width in ((None, 2), ("tensorwise", 1)):
        train = P.Training(seq_len=64, batch_size=2, precision="bf16-fsdp", float8=float8)
        tp = [r for r in P.communication(TINY, train, layout) if r["group"] == "tp"]
        gathered = sum(r["buffer_bytes"] for r in tp if r["kind"] == "all_gather")
        scattered = sum(r["buffer_bytes"] for r in tp if r["kind"] == "reduce_scatter")
        assert gathered == tokens * D * (4 * L * width + 2 * 2) and scattered == tokens * D * (4 * L + 2) * 2


def test_float8_matmuls_run_at_the_float8_rate_and_the_head_at_the_compute_rate():
    # with every other rate infinite, a step is its matmuls: 6 FLOPs per weight and token, the blocks' at the
    # float8 rate (here twice the bf16 one), the output head's at the bf16 rate (one rank, no sharding)
    rates = P.Rates(matmul=1e12, float8=2e12, **FAST)
    train = P.Training(seq_len=64, batch_size=2, precision="bf16-autocast", float8="tensorwise")
    tokens = 2 * 64
    step = P.step_time(TINY, train, P.Layout(), rates)
    assert step["matmul"] == pytest.approx(6 * tokens * (L * LINEAR / 2e12 + V * D / 1e12))
    plain = P.step_time(TINY, P.replace(train, float8=None), P.Layout(), rates)
    assert plain["matmul"] == pytest.approx(6 * tokens * (L * LINEAR + V * D) / 1e12)


def test_a_blocks_backward_holds_its_gathered_float8_weights_in_one_byte():
    # FSDP2 holds two gathered blocks in a block's backward (the one computing, the one prefetched): their linear
    # weights take 1 byte under tensorwise float8, 2 in bf16; nothing else of the phase changes
    train = P.Training(seq_len=64, batch_size=2, precision="bf16-fsdp", checkpointing="full")
    layout = P.Layout(dp_shard=4)
    plain, float8 = (P.memory(TINY, t, layout, 0)["phases"]["a block's backward"]
                     for t in (train, P.replace(train, float8="tensorwise")))
    assert plain - float8 == 2 * LINEAR


def test_async_tp_hides_the_blocks_tp_traffic_behind_their_matmuls():
    # Llama 3 70B on 8 GPUs of one node, TP 8: the blocks' TP collectives are exposed without async TP; with it
    # each overlaps the matmuls it feeds (the larger here), all but the first of tp pieces (ASYNC_TP_RESIDUAL)
    cfg = P.preset("llama3-70b", max_seq_len=4096)
    rates = P.gpu_rates(P.GPUS["H100-80GB"])
    train = P.Training(seq_len=4096, batch_size=1, grad_accum=1, precision="bf16-fsdp", checkpointing="full")
    layout = P.Layout(tp=8)
    sync, overlapped = (P.step_time(cfg, t, layout, rates) for t in (train, P.replace(train, async_tp=True)))
    tp_blocks = P.communication_seconds(cfg, train, layout, rates)["tp_blocks"]
    assert 0 < tp_blocks < sync["matmul"], "comm smaller than the matmuls it can hide behind"
    assert sync["comm_exposed"] - overlapped["comm_exposed"] == pytest.approx(tp_blocks * 7 / 8)
    assert overlapped["seconds"] == pytest.approx(sync["seconds"] - tp_blocks * 7 / 8)


def _plan_cli(*argv):
    return subprocess.run([sys.executable, str(SCRIPTS / "train" / "plan.py"), *argv], capture_output=True,
                          text=True, timeout=600)


def test_the_command_line_plans_float8_async_tp_and_a_schedule_and_says_what_the_recipe_lacks(monkeypatch):
    out = _plan_cli("--model", "llama3-70b", "--gpus", "64", "--gpu", "H100-80GB", "--seq-len", "4096", "--tp", "8",
                    "--pp", "2", "--pp-schedule", "interleaved", "--batch", "64", "--float8", "tensorwise",
                    "--async-tp", "--top", "1")
    assert out.returncode == 0, out.stderr
    command = next(line for line in out.stdout.splitlines() if line.startswith("$ torchrun"))
    assert "--pp-schedule interleaved" in command and "--float8 tensorwise" in command and "--async-tp" not in command
    missing = next(line for line in out.stdout.splitlines() if line.startswith("planned but not in that line"))
    assert "async TP" in missing and "float8" not in missing
    import train as recipe

    monkeypatch.setenv("WORLD_SIZE", "64")
    monkeypatch.setattr(recipe, "uses_gpu", lambda: True)          # the GPUs it plans for: compiled, float8
    monkeypatch.setattr(recipe, "float8_device_fits", lambda job, gpu: None)   # asks CUDA for their float8 cores
    args = recipe.parse_args(command.split("scripts/train/train.py", 1)[1].split())
    assert args.pp_schedule == "interleaved" and args.pp == 2 and args.tp == 8 and args.float8 == "tensorwise"
