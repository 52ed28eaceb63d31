"""The planner's pipeline schedules (scripts/train/plan.py: `schedule_order`, `pipeline_bubble`, `in_flight`)
against torch.distributed.pipelining's own, run on two gloo ranks with the recipe's pipeline.py.

Each schedule (GPipe, 1F1B, interleaved 1F1B, interleaved zero bubble) trains a small Llama split into stages, one
or two per rank as pipeline.py's SCHEDULE_STAGES places them, one step to set up and one recorded: `record_actions`
gives the forwards and backwards each rank ran, in order, and `LiveSavedBytes` the most each rank held for backward
at once. The planned order is the executed one, rank by rank; so the bubble the planner replays from its own order
is the one pipeline.py's `replay` counts from what ran; and the bytes in flight, weighted by what one micro-batch's
forward through each stage saves, are the peak each rank held (a floor under zero bubble, which holds more).
"""
from __future__ import annotations

import statistics
import sys

import pytest

from helpers.paths import SCRIPTS

sys.path.insert(0, str(SCRIPTS / "train"))
import plan as P  # noqa: E402
from config import LlamaArgs  # noqa: E402
from pipeline import bubble_formula, replay  # noqa: E402

CFG = LlamaArgs(vocab_size=64, dim=16, n_layers=4, n_heads=2, n_kv_heads=1, multiple_of=8, max_seq_len=8)
RUNS = [("gpipe", 3), ("1f1b", 2), ("1f1b", 5), ("interleaved", 2), ("interleaved", 4), ("interleaved", 6),
        ("interleaved-zb", 2), ("interleaved-zb", 4), ("interleaved-zb", 6)]


def _run_schedules(cfg, runs, scripts, meter_cls):
    """Every (schedule, micro-batches) of `runs` on this rank's stages: one step to set up, one recorded. Returns
    {run: {'order': [(stage, kind, micro-batch)] as executed, 'peak': bytes held for backward at most, 'one':
    {stage: bytes one micro-batch's forward through it saves, the loss's included}, 'blocks': the same without the
    loss}}."""
    import gc
    import sys
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, scripts)
    from model import Llama, cross_entropy
    from pipeline import SCHEDULE_STAGES, pipeline_schedule, pipeline_split, pipeline_stage, record_actions

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    try:
        rank, world, out = dist.get_rank(), dist.get_world_size(), {}
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
        for name, m in runs:
            chunks, style = SCHEDULE_STAGES[name]
            modules, stages = [], []
            for chunk in range(chunks):
                with torch.device("meta"):
                    model = pipeline_split(Llama(cfg), mesh, chunk, chunks, style)
                model.to_empty(device="cpu")
                model.init_weights(0)
                modules.append(model)
                stages.append(pipeline_stage(model, mesh, torch.device("cpu"), chunk, chunks, style))
            schedule = pipeline_schedule(stages if chunks > 1 else stages[0], name, m, cross_entropy)
            x = torch.randint(0, cfg.vocab_size, (m, cfg.max_seq_len), generator=torch.Generator().manual_seed(m))
            y = x.roll(-1, 1)

            def step():
                if rank == 0:
                    schedule.step(x)
                else:
                    schedule.step(target=y, losses=[])

            step()
            log, meter = [], meter_cls()
            for stage in stages:
                record_actions(stage, log)
            with meter:
                step()
            one, blocks = {}, {}
            for stage, model in zip(stages, modules):      # one micro-batch's forward through the stage alone
                h = x[:1] if stage.is_first else torch.randn(1, cfg.max_seq_len, cfg.dim, requires_grad=True)
                probe = meter_cls()
                with probe:
                    logits = model(h)
                    blocks[stage.stage_index] = probe.peak
                    if stage.is_last:
                        cross_entropy(logits, y[:1])
                one[stage.stage_index] = probe.peak
            out[f"{name} {m}"] = {"order": [(s, k, mb) for s, k, mb, *_ in sorted(log, key=lambda e: e[3])],
                                  "peak": meter.peak, "one": one, "blocks": blocks}
        return out
    finally:
        gc.collect()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ran():
    import helpers
    from helpers.measure.activations import LiveSavedBytes

    ranks = helpers.launch(_run_schedules, CFG, RUNS, str(SCRIPTS / "train"), LiveSavedBytes, world_size=2,
                           timeout=600, quiet=True)
    return {run: {rank: got[run] for rank, got in enumerate(ranks)} for run in ranks[0]}


def test_the_planner_knows_each_schedules_stages_per_rank():
    from pipeline import SCHEDULE_STAGES

    assert P.SCHEDULES == {name: chunks for name, (chunks, _) in SCHEDULE_STAGES.items() if name != "zbv"}


@pytest.mark.parametrize("name,m", RUNS)
def test_the_planned_order_is_the_order_torch_ran(ran, name, m):
    for rank, got in ran[f"{name} {m}"].items():
        assert got["order"] == list(P.schedule_order(name, 2, m, rank)), f"{name}, m = {m}, rank {rank}"


@pytest.mark.parametrize("name,m", RUNS)
@pytest.mark.parametrize("backward", [1.0, 2.0, 3.0])
def test_the_planned_bubble_is_the_executed_one(ran, name, m, backward):
    # a backward of 1, 2 or 3 forwards (2: the FLOPs; 3: with full checkpointing's recomputation); split in two
    # equal halves where zero bubble splits it, as pipeline.py's replay splits it by default
    orders = {rank: got["order"] for rank, got in ran[f"{name} {m}"].items()}
    measured = replay(orders, backward_cost=backward)["idle_fraction"]
    planned = statistics.mean(P.pipeline_bubble(name, 2, m, P.SCHEDULES[name], backward / 2, backward / 2))
    assert planned == pytest.approx(measured, abs=1e-12)
    if name in ("gpipe", "1f1b", "interleaved"):
        assert measured == pytest.approx(bubble_formula(2, m, P.SCHEDULES[name]))


@pytest.mark.parametrize("name,m", RUNS)
def test_the_bytes_in_flight_are_the_peak_each_rank_held(ran, name, m):
    # the forwards not yet freed (by B, or by W where zero bubble splits the backward), each weighted by what one
    # micro-batch's forward through its stage saves: the most the rank held for backward during the step. Under
    # zero bubble torch frees the loss's tensors at I but keeps part of a later stage's past W (the graph below its
    # weight matmuls, to the step's end): the count without the loss is a floor there, every forward held a ceiling.
    for rank, got in ran[f"{name} {m}"].items():
        order = P.schedule_order(name, 2, m, rank)
        planned = P.in_flight(order, got["one"])
        if name == "interleaved-zb":
            assert P.in_flight(order, got["blocks"]) <= got["peak"] <= sum(got["one"][s] for s, kind, _ in order
                                                                           if kind == "F")
        else:
            assert got["peak"] == planned, f"{name}, m = {m}, rank {rank}"
    if name == "1f1b":
        assert [P.in_flight(P.schedule_order(name, 2, m, r)) for r in range(2)] == [2, 1], "pp - s on stage s"
