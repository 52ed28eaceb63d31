"""The recipe's float8 training (scripts/train/float8.py, notebook 05), emulated on CPU ranks as torchao allows: a
2-rank FSDP2 run and a tensor-parallel 2 run, each in bf16, in float8 tensorwise and in float8 rowwise, from the same
weights on the same batches; the checkpoint a float8 run writes (model and optimizer, two steps before the end),
resumed by a float8 run bit for bit and loaded by a process that never imports torchao; the shape rules MFU and the
planner read; and what float8 refuses.

The tolerance. e4m3 keeps 3 mantissa bits: each operand of a float8 matmul is rounded to within 2^-4 of itself
(relative), a few per cent of noise on every product, which a batch's mean loss mostly averages away; then a few
Adam steps carry it on. Measured while writing this (tiny Llama, 2 layers, 8 x 32 tokens a step, lr 3e-3, 10
steps): float8 stayed within 0.2% of bf16's loss at every step, tensorwise and rowwise, FSDP2 and TP alike. bf16
itself moved fp32's loss by about 0.05%. LOSS_RTOL allows 1%, five times that: loose enough for another machine's
summation order, and still tight against what breaks float8 (a scale lost saturates e4m3 at 448; a weight whose
gradient is dropped stops learning), which moves the loss by tenths within these steps.
"""
from __future__ import annotations

import sys

import pytest

from helpers import launch
from helpers.devices import CPU_ONLY_ENV
from helpers.paths import SCRIPTS

if str(SCRIPTS / "train") not in sys.path:  # the recipe's modules, imported by name as the notebooks do
    sys.path.insert(0, str(SCRIPTS / "train"))

LOSS_RTOL = 0.01
STEPS = 6
MODES = ("bf16", "tensorwise", "rowwise")
SHAPE = {"dim": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "seq_len": 32, "batch": 8}


def train_modes(tp: int, ckpt_dir: str | None):
    """Every rank: the recipe's Llama at FSDP2 2 (tp 1) or TP 2, in each mode, STEPS steps; the losses and the
    names converted. With `ckpt_dir` (FSDP2), tensorwise saves model and optimizer (get_state_dict, DCP) two steps
    before the end, with the model's whole weights kept for comparison; then a fresh float8 model loads it and
    takes the last two steps again."""
    import contextlib
    import gc

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    import float8
    import parallelize as par
    from model import Llama, cross_entropy
    from tp import apply_tp

    dist.init_process_group("gloo")
    model = opt = None
    try:
        world = dist.get_world_size()
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp_shard", "tp"))
        shards, dp, dp_rank = world // tp > 1, world // tp, mesh.get_local_rank("dp_shard")
        from pydoc_data.topics import topics
        text = torch.tensor(list("\n\n".join(topics[k] for k in sorted(topics)).encode()))
        g = torch.Generator().manual_seed(1)
        starts = [torch.randint(0, len(text) - SHAPE["seq_len"] - 1, (SHAPE["batch"],), generator=g)
                  for _ in range(STEPS)]
        batches = [torch.stack([text[s:s + SHAPE["seq_len"] + 1] for s in step])[dp_rank::dp] for step in starts]

        def build(mode):
            with torch.device("meta"):
                model = Llama(config())
            converted = [] if mode == "bf16" else float8.apply_float8(model, mode, shards, emulate=True, tp=tp)
            if tp > 1:
                apply_tp(model, mesh["tp"], loss_parallel=True)
            if shards:
                par.apply_fsdp(model, mesh["dp_shard"], param_dtype=torch.bfloat16)
            model.to_empty(device="cpu")
            model.init_weights(0)
            return model, torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1), converted

        def step(model, opt, batch, mode) -> float:
            with contextlib.ExitStack() as context:
                if tp > 1:
                    context.enter_context(loss_parallel())
                if not shards:            # the recipe's bf16 where FSDP2 does not cast: autocast
                    context.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
                loss = cross_entropy(model(batch[:, :-1]), batch[:, 1:])
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if mode == "tensorwise" and shards:
                float8.precompute_scales(model)
            mean = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().float().reshape(1)
            dist.all_reduce(mean)
            return mean.item() / world

        out = {}
        for mode in MODES:
            model, opt, converted = build(mode)
            losses = []
            for i, batch in enumerate(batches):
                if ckpt_dir and mode == "tensorwise" and i == STEPS - 2:
                    model_state, optim_state = get_state_dict(model, opt)
                    out["saved_types"] = sorted({type(v.to_local() if isinstance(v, DTensor) else v).__name__
                                                 for v in model_state.values()})
                    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=ckpt_dir)
                    out["weights"] = {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone()
                                      for k, v in model_state.items()}
                losses.append(step(model, opt, batch, mode))
            out[mode] = {"losses": losses, "converted": converted,
                         "types": sorted({type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.Linear)})}
        if ckpt_dir:
            model, opt, _ = build("tensorwise")
            model_state, optim_state = get_state_dict(model, opt)
            state = {"model": model_state, "optim": optim_state}
            dcp.load(state, checkpoint_id=ckpt_dir)
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            out["resumed"] = [step(model, opt, batch, "tensorwise") for batch in batches[-2:]]
        return out
    finally:
        model = opt = None
        gc.collect()
        dist.destroy_process_group()


def config():
    from config import preset

    return preset("tiny", vocab_size=256, dim=SHAPE["dim"], n_layers=SHAPE["n_layers"], n_heads=SHAPE["n_heads"],
                  n_kv_heads=SHAPE["n_kv_heads"], max_seq_len=SHAPE["seq_len"])


def load_without_torchao(ckpt_dir: str) -> dict:
    """One process, torchao never imported: the checkpoint into a plain Llama's state dict (DCP without a process
    group), as a bf16 run that resumes from it would read it."""
    import torch.distributed.checkpoint as dcp

    from model import Llama

    model = Llama(config())
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=ckpt_dir)
    model.load_state_dict(state["model"])
    return {"torchao_imported": "torchao" in sys.modules, "weights": {k: v.clone() for k, v in state["model"].items()}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt_dir = str(tmp_path_factory.mktemp("float8") / "ckpt")
    fsdp = launch(train_modes, 1, ckpt_dir, world_size=2, timeout=900, env=CPU_ONLY_ENV)
    tp = launch(train_modes, 2, None, world_size=2, timeout=900, env=CPU_ONLY_ENV)
    loaded = launch(load_without_torchao, ckpt_dir, world_size=1, timeout=300, env=CPU_ONLY_ENV)[0]
    return {"fsdp": fsdp, "tp": tp, "loaded": loaded}


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_float8_trains_within_loss_rtol_of_bf16(runs, layout):
    from float8 import float8_linear_names

    r, cfg = runs[layout][0], config()
    every = sorted(f"layers.{b}.{n}" for b in range(cfg.n_layers) for n in float8_linear_names(cfg))
    assert len(every) == 7 * cfg.n_layers, "at these sizes every block linear takes float8"
    bf16 = r["bf16"]["losses"]
    assert bf16[-1] < bf16[0] - 0.5, f"bf16 learned: {bf16}"
    for mode in MODES[1:]:
        assert sorted(r[mode]["converted"]) == every
        assert r[mode]["types"] == ["Float8Linear", "Linear"], "block linears converted, the output layer not"
        gaps = [abs(a - b) / b for a, b in zip(r[mode]["losses"], bf16)]
        assert max(gaps) < LOSS_RTOL, f"{layout} {mode}: {r[mode]['losses']} against bf16's {bf16}"
        assert r[mode]["losses"] != bf16, "float8 changed the arithmetic (emulation is not a no-op)"


def test_a_float8_run_resumed_from_its_checkpoint_takes_the_same_steps_bit_for_bit(runs):
    r = runs["fsdp"][0]
    assert r["resumed"] == r["tensorwise"]["losses"][-2:], "weights, optimizer state and the scales they give"


def test_a_float8_checkpoint_holds_plain_tensors_that_a_run_without_torchao_loads(runs):
    saved, loaded = runs["fsdp"][0], runs["loaded"]
    assert saved["saved_types"] == ["Tensor"], "no torchao class in the state dict"
    assert not loaded["torchao_imported"]
    assert sorted(loaded["weights"]) == sorted(saved["weights"])
    for name, weight in saved["weights"].items():
        assert loaded["weights"][name].dtype == weight.dtype == __import__("torch").float32, name   # master weights
        assert loaded["weights"][name].equal(weight), name


def test_the_linears_float8_takes_are_those_whose_piece_has_dimensions_a_multiple_of_16():
    from config import LlamaArgs
    from float8 import float8_linear_names

    cfg = LlamaArgs(vocab_size=256, dim=96, n_layers=1, n_heads=6, n_kv_heads=2, multiple_of=8, max_seq_len=8)
    assert cfg.head_dim == 16 and cfg.hidden == 256
    assert len(float8_linear_names(cfg)) == 7
    # tp 4: wk and wv's pieces have 32 / 4 = 8 output features; wq's 96 / 4 = 24 (not a multiple of 16 either)
    assert sorted(float8_linear_names(cfg, tp=4)) == ["feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]
    odd = LlamaArgs(vocab_size=256, dim=72, n_layers=1, n_heads=4, n_kv_heads=4, multiple_of=8, max_seq_len=8)
    assert float8_linear_names(odd) == [], "dim 72: no block linear has both dimensions a multiple of 16"


def test_the_float8_flop_share_counts_the_converted_linears_of_the_built_model():
    import torch

    from config import preset
    from float8 import apply_float8, float8_flop_share, float8_weights

    cfg = preset("small", vocab_size=32000)
    from model import Llama
    with torch.device("meta"):
        model = Llama(cfg)
    converted = apply_float8(model, "tensorwise", shards=False, emulate=True)
    weights = sum(model.get_submodule(name).weight.numel() for name in converted)
    assert float8_weights(cfg) == weights
    share = float8_flop_share(cfg, 1024)
    assert share == 6 * weights / cfg.flops_per_token(1024)
    assert 0.5 < share < 1, "most of a step's FLOPs, not the output layer's nor the attention scores'"


def test_mixed_peak_weighs_each_part_by_its_time():
    from float8 import mixed_peak

    assert mixed_peak(0.0, 2e15, 1e15) == pytest.approx(1e15) and mixed_peak(1.0, 2e15, 1e15) == pytest.approx(2e15)
    # half the FLOPs at twice the rate take a quarter of the time: all of them in 3/4 of bf16's
    assert mixed_peak(0.5, 2e15, 1e15) == pytest.approx(1e15 / 0.75)


@pytest.mark.parametrize("name, capability, rocm, refused", [
    ("NVIDIA A100-SXM4-80GB", (8, 0), False, True), ("NVIDIA A10G", (8, 6), False, True),
    ("Tesla V100-SXM2-32GB", (7, 0), False, True), ("Tesla T4", (7, 5), False, True),
    ("NVIDIA L4", (8, 9), False, False), ("NVIDIA H100 80GB HBM3", (9, 0), False, False),
    ("NVIDIA B200", (10, 0), False, False), ("AMD Instinct MI250X", (9, 0), True, True),
    ("AMD Instinct MI300X", (9, 4), True, False)])
def test_a_gpu_without_float8_tensor_cores_is_refused_in_one_line(name, capability, rocm, refused):
    from float8 import check_float8_device

    if not refused:
        check_float8_device(name, capability, rocm)
        return
    with pytest.raises(ValueError) as caught:
        check_float8_device(name, capability, rocm)
    assert name in str(caught.value) and "float8 tensor cores" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_rowwise_with_the_float8_all_gather_and_an_unknown_recipe_are_refused():
    import torch

    from config import preset
    from float8 import apply_float8
    from model import Llama

    with torch.device("meta"):
        model = Llama(preset("tiny", vocab_size=256))
    with pytest.raises(ValueError, match="one scale per tensor"):
        apply_float8(model, "rowwise", shards=True, emulate=True, float8_all_gather=True)
    with pytest.raises(ValueError, match="choose one of tensorwise, rowwise"):
        apply_float8(model, "blockwise", shards=True, emulate=True)
    assert not any(type(m).__name__ == "Float8Linear" for m in model.modules()), "refused before converting"


def test_a_float8_step_is_measured_against_the_float8_peak_for_its_float8_share_only():
    from float8 import float8_datasheet_peak
    from hardware import datasheet_peak

    bf16, float8 = datasheet_peak("NVIDIA H100 80GB HBM3", "bf16"), datasheet_peak("NVIDIA H100 80GB HBM3", "float8")
    assert float8[0] > bf16[0], "the H100's float8 rate is above its bf16 rate"
    peak, source = float8_datasheet_peak("NVIDIA H100 80GB HBM3", "bf16", 0.75)
    assert bf16[0] < peak < float8[0] and "75%" in source
    assert float8_datasheet_peak("NVIDIA A100-SXM4-80GB", "bf16", 0.75) is None, "no float8 row: no float8 peak"


def _train_refuses(argv, world, monkeypatch, capsys, gpu=None) -> str:
    """train.py's argument check on `world` ranks of a CPU, or of a GPU named and numbered as `gpu` says."""
    import torch

    import train

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setattr(train, "uses_gpu", lambda: gpu is not None)
    if gpu is not None:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu[0])
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: gpu[1])
        monkeypatch.setattr(torch.version, "hip", None)
    with pytest.raises(SystemExit) as refused:
        train.parse_args(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and len(lines) == 1 and lines[0].startswith("train.py: error: "), lines
    return lines[0].removeprefix("train.py: error: ")


@pytest.mark.parametrize("argv, world, gpu, refusal", [
    (["--float8", "tensorwise"], 8, ("NVIDIA A100-SXM4-80GB", (8, 0)), "NVIDIA A100-SXM4-80GB (compute capability "
     "8.0) has no float8 tensor cores"),
    (["--float8", "tensorwise", "--compile"], 2, None, "--float8 on CPUs is torchao's emulation, which runs eager"),
    (["--float8", "tensorwise", "--moe-experts", "4"], 2, None, "--float8 with --moe-experts"),
    (["--float8", "rowwise", "--seq-len", "40", "--batch", "2", "--cp", "2"], 2, None,
     "a rank multiplies 40 tokens per micro-batch, not a multiple of 16"),     # 2 sequences of 40 / cp 2 each
    (["--float8", "blockwise"], 2, None, "argument --float8: invalid choice: 'blockwise'"),
])
def test_train_py_refuses_what_float8_cannot_run_in_one_line(argv, world, gpu, refusal, monkeypatch, capsys):
    assert refusal in _train_refuses(argv, world, monkeypatch, capsys, gpu)


def test_train_py_takes_float8_on_a_gpu_with_float8_tensor_cores_and_on_cpus(monkeypatch):
    import torch

    import train

    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setattr(train, "uses_gpu", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    job = train.parse_args(["--float8", "tensorwise", "--tp", "2"])
    assert job.float8 == "tensorwise" and job.float8_all_gather, "FSDP2 over 4: its weights gathered in float8"
    monkeypatch.setattr(train, "uses_gpu", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not train.parse_args(["--float8", "rowwise"]).float8_all_gather, "rowwise gathers in the training dtype"
    assert not train.parse_args(["--float8", "tensorwise", "--tp", "2"]).float8_all_gather, "no shards: nothing gathered"
    assert train.parse_args([]).float8 is None


def test_train_py_in_float8_logs_its_mfu_rule_and_a_bf16_run_resumes_its_checkpoint(tmp_path):
    """Two ranks of train.py under torchrun: FSDP2 in float8 tensorwise, 4 steps with a checkpoint at step 2; then
    the same command without --float8 resumes that checkpoint (plain tensors: it never imports torchao) and
    trains to step 6. The first line says float8 and what its MFU is measured against."""
    import json

    from helpers.cluster.torchrun import run_torchrun

    common = ["--dim", "64", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2", "--seq-len", "32", "--batch",
              "8", "--dtype", "bf16", "--log-every", "1", "--eval-windows", "16", "--ckpt-dir", tmp_path / "ckpt",
              "--save-every", "2", "--metrics", tmp_path / "metrics.jsonl"]
    env = {"CUDA_VISIBLE_DEVICES": "", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    first = run_torchrun(SCRIPTS / "train" / "train.py", *common, "--float8", "tensorwise", "--steps", "2",
                         nproc=2, env=env, timeout=600, echo=False)
    assert first.returncode == 0, first.output[-3000:]
    line = next(line for line in first.output.splitlines() if "training a" in line)
    assert "float8 tensorwise (emulated)" in line and "no float8 datasheet row for cpu devices" in line, line
    second = run_torchrun(SCRIPTS / "train" / "train.py", *common, "--steps", "4", nproc=2, env=env, timeout=600,
                          echo=False)
    assert second.returncode == 0, second.output[-3000:]
    assert "resumed from" in second.output and "float8" not in second.output.split("training a")[1].split(":")[0]
    losses = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in losses if "loss" in m] == [1, 2, 3, 4], "each step once, float8 then bf16"
