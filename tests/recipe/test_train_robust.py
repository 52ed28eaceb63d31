"""The training recipe's train.py and measure.py (made of notebook 09's cells) under the faults and questions a
cluster brings, one piece at a time, in this process (the pieces take no process group, or a stand-in for one)
and, for the pipeline's evaluation, on 2 real processes (helpers.launch):
- more ranks on a node than GPUs is one line and exit status 2, not a silent fall back to the CPU;
- the test hooks (--crash-at, --crash-signal) are not among --help's flags;
- the ranks agree on a SIGTERM with one collective every --stop-check-every steps, none in between, and one
  process with none at all;
- the metrics file holds each step once after a resume;
- the peak memory is the window's (reset at each log line), and evaluation and checkpoint time is set aside from
  tokens/s;
- the pipeline's evaluation builds its schedule once for the run, not once per batch.
The runs that prove the rest end to end (SIGTERM within one check, dropout resumed bit for bit, the TensorBoard,
profiler and memory-snapshot flags) are tests/recipe/test_train_recipe.py's."""
from __future__ import annotations

import json
import signal
import sys

import pytest
import torch

from helpers.paths import SCRIPTS

sys.path.insert(0, str(SCRIPTS / "train"))  # the recipe's modules import each other by name, as train.py does
import measure  # noqa: E402
import train  # noqa: E402


def test_more_ranks_on_a_node_than_gpus_is_one_line_and_status_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_:
        train.parse_args(["--steps", "1"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("train.py: error: 2 ranks on this node but 1 visible GPU"), lines


def test_the_test_hooks_are_not_among_the_flags_help_shows():
    shown = train.build_parser().format_help()
    assert "--crash" not in shown and "--stop-check-every" in shown
    args = train.build_parser().parse_args(["--crash-at", "3", "--crash-signal", "TERM"])
    assert (args.crash_at, args.crash_signal) == (3, "TERM"), "hidden, still accepted"


@pytest.fixture
def sigterm_restored():
    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)


def test_the_ranks_agree_on_a_stop_every_n_steps_with_one_collective(monkeypatch, sigterm_restored):
    calls = []

    def all_reduce(tensor, op=None):
        calls.append(tensor.item())

    monkeypatch.setattr(train.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(train.dist, "all_reduce", all_reduce)
    stop = train.StopFlag(every=3)
    assert [stop.agreed(step) for step in range(1, 5)] == [False] * 4 and calls == [0], "one collective, at step 3"
    stop._handle(signal.SIGTERM, None)                      # the signal arrives after step 4
    assert not stop.agreed(5) and stop.agreed(6), "the stop comes at the next check, within 3 steps"
    assert len(calls) == 2
    monkeypatch.setattr(train.dist, "get_world_size", lambda: 1)
    alone = train.StopFlag(every=3)
    alone._handle(signal.SIGTERM, None)
    assert alone.agreed(1) and len(calls) == 2, "one process: every step, no collective"


def test_the_metrics_file_holds_each_step_once_after_a_resume(tmp_path):
    path = tmp_path / "m.jsonl"
    lines = [{"step": s, "loss": float(s)} for s in (1, 2, 3)] + [{"step": 2, "eval_loss": 0.5}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 4, "lo')   # cut by a kill
    with measure.open_metrics(path, start_step=2) as metrics:  # resumed from step 2's checkpoint
        measure.write_metrics(metrics, step=3, loss=30.0)
    kept = [json.loads(x) for x in path.read_text().splitlines()]
    assert kept == [lines[0], lines[1], lines[3], {"step": 3, "loss": 30.0}]
    with measure.open_metrics(path, start_step=0):               # a run from scratch
        pass
    assert path.read_text() == ""


def test_the_peak_memory_is_the_windows_on_a_cpu():
    import numpy as np

    cpu = torch.device("cpu")
    if not measure.reset_peak_memory(cpu):
        pytest.skip("no /proc/self/clear_refs here: the peak runs from the start, and the log line says so")
    big = np.ones(256 << 20, dtype=np.uint8)                   # 256 MiB, touched
    with_big = measure.peak_memory(cpu)[0]
    del big
    assert measure.reset_peak_memory(cpu)
    after = measure.peak_memory(cpu)
    assert after[1] is None, "a CPU has no reserved memory apart"
    assert after[0] < with_big - (200 << 20), (with_big, after)


def test_evaluation_and_checkpoint_time_is_set_aside_from_tokens_per_second(monkeypatch, capsys):
    import types

    clock = iter([0.0, 2.0, 5.0, 10.0, 10.0])                  # start; eval from 2 to 5; the line at 10; restart
    monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    monkeypatch.setattr(measure.dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(measure.hardware, "measured_matmul_peak", lambda device, dtype: 1e12)
    meter = measure.Meter(4 * 16, 1_000_000, 10, torch.device("cpu"), torch.float32)   # 4 sequences of 16 a step
    meter.steps = 7
    with meter.set_aside("eval"):
        pass
    meter.report(0, 7, 1.0, 1e-3, 0.5)
    assert meter.tokens_per_s == 7 * 4 * 16 / (10 - 3), "7 steps' tokens over 7 s of training"
    assert meter.totals == {"eval": 3.0, "checkpoint": 0.0}
    assert "(not counted: eval 3.0 s)" in capsys.readouterr().out


def _count_pipeline_schedules(tokens):
    """A 2-stage pipeline's Trainer, evaluated twice: how many schedules it built, for training and evaluating."""
    import train

    built = []
    make = train.pipeline_schedule

    def counted(*args, **kwargs):
        built.append(args[1])
        return make(*args, **kwargs)

    train.pipeline_schedule = counted
    flags = ["--data", tokens, "--dim", "32", "--n-layers", "2", "--n-heads", "4", "--seq-len", "16", "--batch", "8",
             "--pp", "2", "--accum", "2", "--eval-windows", "32", "--dtype", "fp32", "--no-compile"]

    def body(device):
        trainer = train.Trainer(train.parse_args(flags), device)
        losses = [trainer.evaluate() for _ in range(2)]
        return {"built": built, "losses": losses}

    return train.run_distributed(body)


@pytest.mark.timeout(180)
def test_the_pipelines_evaluation_builds_its_schedule_once(tmp_path):
    import data

    from helpers.launcher import launch

    tokens = data.prepare([data.default_corpus_text()[:100_000]], tmp_path / "tokens.bin")
    ranks = launch(_count_pipeline_schedules, str(tokens), world_size=2, timeout=150,
                   env={"CUDA_VISIBLE_DEVICES": ""})
    for rank in ranks:
        # 32 held-out windows in batches of 4: 8 batches an evaluation, each with its own schedule before
        assert rank["built"] == ["1f1b", "gpipe"], rank["built"]
        assert rank["losses"][0] == rank["losses"][1]


def _initialise_at_two_layouts():
    """The Llama initialised whole in one process, sharded by FSDP2 and split by tensor parallelism on these ranks:
    every parameter gathered whole, and how many numbers this rank drew from a generator for each."""
    import torch
    import torch.distributed as dist

    from config import preset
    from model import Llama
    from parallelize import apply_fsdp, build_mesh
    from tp import apply_tp

    drawn, normal = [0], torch.Tensor.normal_

    def counted(tensor, *args, **kwargs):
        drawn[0] += tensor.numel()
        return normal(tensor, *args, **kwargs)

    torch.Tensor.normal_ = counted
    cfg = preset("tiny", dim=256, n_layers=2, n_heads=4, vocab_size=512, max_seq_len=32)
    dist.init_process_group("gloo")
    world, out = dist.get_world_size(), {}
    try:
        for name, (shard, tp) in {"fsdp": (world, 1), "tp": (1, world), "whole": (None, None)}.items():
            if shard is None:
                model = Llama(cfg)
            else:
                with torch.device("meta"):
                    model = Llama(cfg)
                mesh = build_mesh(world, 1, shard, tp, 1, "cpu", cfg, 32)
                apply_tp(model, mesh["tp"], loss_parallel=True) if tp > 1 else apply_fsdp(model, mesh["dp_shard"])
                model.to_empty(device="cpu")
            drawn[0] = 0
            model.init_weights(seed=3)
            params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
                      for k, v in model.state_dict().items()}
            out[name] = {"drawn": drawn[0], "params": params}
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_each_rank_draws_only_the_rows_it_holds_and_every_layout_gets_the_same_weights():
    """init_weights used to draw every parameter whole on every rank (then keep a piece): the whole model's draws on
    every rank. Now a rank draws the 64-row blocks its piece lies in."""
    from helpers.launcher import launch

    ranks = launch(_initialise_at_two_layouts, world_size=2, timeout=150, env={"CUDA_VISIBLE_DEVICES": ""})
    whole = ranks[0]["whole"]
    for rank in ranks:
        for layout in ("fsdp", "tp"):
            torch.testing.assert_close(rank[layout]["params"], whole["params"], rtol=0, atol=0)
        assert rank["fsdp"]["drawn"] < 0.6 * whole["drawn"], (rank["fsdp"]["drawn"], whole["drawn"])
        assert rank["tp"]["drawn"] < whole["drawn"], "tensor parallel: its column-wise pieces' rows only"
