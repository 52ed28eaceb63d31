# From the PyTorch distributed cookbook: the cells tagged 'script:train/pipeline.py' in
#   notebooks/08_pipeline_parallel.ipynb
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
"""The pipeline split: this rank's stage of the model, its PipelineStage, a schedule, a record of what the schedule
ran, and the bubble counted from that record."""
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


# Per schedule: the stages on each rank and how they are placed ("loop": rank r of p holds stages r, r + p, ...;
# "v": rank r holds stages r and 2p - 1 - r, the first and last on rank 0). The zero-bubble schedules split each
# backward into its input-gradient and weight-gradient halves and fill the pipeline's idle slots with the latter.
SCHEDULE_STAGES = {"gpipe": (1, "loop"), "1f1b": (1, "loop"), "interleaved": (2, "loop"),
                   "interleaved-zb": (2, "loop"), "zbv": (2, "v")}


def _stage_index(pp_mesh: DeviceMesh, chunk: int, chunks: int, style: str = "loop") -> tuple[int, int]:
    """(this stage's index, the number of stages) of this rank's `chunk` of `chunks`, placed as `style` says (above):
    in a loop the interleaved schedule's stages on one rank are not neighbours; a V brings them back."""
    rank, p = pp_mesh.get_local_rank(), pp_mesh.size()
    if style == "v":
        if chunks != 2:
            raise ValueError(f"a V places 2 stages on each rank, not {chunks}")
        return (rank if chunk == 0 else 2 * p - 1 - rank), 2 * p
    return rank + chunk * p, chunks * p


def pipeline_split(model: nn.Module, pp_mesh: DeviceMesh, chunk: int = 0, chunks: int = 1,
                   style: str = "loop") -> nn.Module:
    """Keep this rank's stage of the model, before any other parallelism is applied: the first stage the embedding
    and its share of the blocks, the last its share and the final norm and output (config.stage_layers: the
    embedding and the output count as a block each, the first stages take the remainder). Blocks keep their names,
    so the stages' state dicts together are the whole model's. For several stages per rank, split one copy per
    `chunk` (placed as `style`: SCHEDULE_STAGES)."""
    return split_at(model, *_stage_index(pp_mesh, chunk, chunks, style))


def split_at(model: nn.Module, stage: int, n_stages: int) -> nn.Module:
    """`pipeline_split` at a stage index given outright, with no mesh (a V's stages are r and 2p - 1 - r)."""
    from config import stage_layers

    names = list(model.layers)
    if len(names) < n_stages:
        raise ValueError(f"{len(names)} layers do not fill {n_stages} stages")
    mine = {names[i] for i in stage_layers(len(names), n_stages, stage)}
    for name in names:
        if name not in mine:
            del model.layers[name]
    if stage != 0:
        model.tok_embeddings = None
    if stage != n_stages - 1:
        model.norm = model.output = None
    return model


def pipeline_stage(model: nn.Module, pp_mesh: DeviceMesh, device: torch.device, chunk: int = 0, chunks: int = 1,
                   style: str = "loop"):
    """The PipelineStage of a split, parallelized and materialized model (the stage sends and receives the
    activations between neighbouring ranks of `pp_mesh`; their shapes are found at the first step)."""
    from torch.distributed.pipelining import PipelineStage

    stage, n_stages = _stage_index(pp_mesh, chunk, chunks, style)
    return PipelineStage(model, stage, n_stages, device, group=pp_mesh.get_group())


def pipeline_schedule(stage, name: str, n_microbatches: int, loss_fn):
    """GPipe (all forwards, then all backwards) or 1F1B (one forward, one backward: fewer activations alive) on a
    stage; "interleaved" (1F1B over several stages per rank: a smaller bubble), "interleaved-zb" and "zbv" (the
    zero-bubble schedules: notebook 08b) on the list of this rank's stages. Each averages the micro-batches'
    gradients (scale_grads)."""
    from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                              ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)

    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
           "interleaved-zb": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble}[name]
    return cls(stage, n_microbatches=n_microbatches, loss_fn=loss_fn)


class StagesView(nn.Module):
    """This rank's stages (several: an interleaved or V schedule's) seen as one model under the whole model's names,
    for what needs one module: the optimizer, the gradient norm, the checkpoint (get_state_dict), loading weights.
    It holds the stages' own modules, shared, not copies: the blocks keep their names (layers.<i>), so the state
    dict is the one every other layout saves; a stage without the embedding or the output leaves it None here."""

    def __init__(self, stages: list[nn.Module]):
        super().__init__()
        self.cfg = stages[0].cfg
        self.tok_embeddings = next((m.tok_embeddings for m in stages if m.tok_embeddings is not None), None)
        self.layers = nn.ModuleDict({name: block for m in stages for name, block in m.layers.items()})
        self.norm = next((m.norm for m in stages if m.norm is not None), None)
        self.output = next((m.output for m in stages if m.output is not None), None)


def record_actions(stage, log: list) -> None:
    """Wrap a PipelineStage's work on one micro-batch so that each call appends (stage index, kind, micro-batch,
    start, end) to `log`, on the host's clock (time.perf_counter: comparable across the processes of one machine).
    Why: a schedule's own description (`pipeline_order`) is not always what its `step` runs; these calls are.
    kind: "F" forward, "B" backward and, where a zero-bubble schedule splits a backward in two, "I" (the input's
    gradient: `backward_one_chunk(full_backward=False)`) and "W" (the weights': `backward_weight_one_chunk`)."""
    import time

    def recorded(kind, original):
        def call(mb, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(mb, *args, **kwargs)
            finally:
                ran = kind if kwargs.get("full_backward", True) else "I"
                log.append((stage.stage_index, ran, int(mb), start, time.perf_counter()))
        return call

    stage.forward_one_chunk = recorded("F", stage.forward_one_chunk)
    stage.backward_one_chunk = recorded("B", stage.backward_one_chunk)
    stage.backward_weight_one_chunk = recorded("W", stage.backward_weight_one_chunk)


def bubble_formula(p: int, m: int, v: int = 1) -> float:
    """The idle fraction of a pipeline step with equal stages: p ranks, v stages each, m micro-batches. Filling and
    draining the pipe cost p - 1 slots against v·m slots of work: (p - 1)/(v·m + p - 1)."""
    return (p - 1) / (v * m + p - 1)


def depends_on(action: tuple, last_stage: int) -> list[tuple]:
    """The actions one of which must have finished before `action` (stage, kind, micro-batch) can start. A forward
    needs the previous stage's forward of its micro-batch. A backward of the input (B, or I where the backward is
    split) needs the next stage's (B or I), and on the last stage its own forward: the loss. W, the weights' half,
    needs its own stage's I."""
    stage, kind, mb = action
    if kind == "F":
        return [(stage - 1, "F", mb)] if stage > 0 else []
    if kind == "W":
        return [(stage, "I", mb)]
    if stage == last_stage:
        return [(stage, "F", mb)]
    return [(stage + 1, "B", mb), (stage + 1, "I", mb)]


def replay(orders: dict, forward_cost: float = 1.0, backward_cost: float = 1.0,
           weight_cost: float | None = None) -> dict:
    """Run each rank's actions in the order it executed them ({rank: [(stage, kind, mb)]}) on one clock: an action
    starts when its rank is free and what it depends on has finished. F costs `forward_cost`, B `backward_cost`,
    W `weight_cost` (default half of B) and I the rest of B. Returns the step's length ('makespan'), the share of
    rank-slots idle ('idle_fraction') and each rank's working time ('busy': the planner's bubble per rank);
    ValueError for an order that cannot run (no rank can take its next action)."""
    last_stage = max(stage for actions in orders.values() for stage, _, _ in actions)
    weight = backward_cost / 2 if weight_cost is None else weight_cost
    cost = {"F": forward_cost, "B": backward_cost, "I": backward_cost - weight, "W": weight}
    done, clock = {}, {rank: 0.0 for rank in orders}
    position, busy = {rank: 0 for rank in orders}, {rank: 0.0 for rank in orders}
    while any(position[r] < len(actions) for r, actions in orders.items()):
        progressed = False
        for rank, actions in orders.items():
            while position[rank] < len(actions):
                action = actions[position[rank]]
                needs = depends_on(action, last_stage)
                finished = [done[a] for a in needs if a in done]
                if needs and not finished:
                    break                                     # this rank waits; try the next one
                done[action] = clock[rank] = max([clock[rank], *finished]) + cost[action[1]]
                busy[rank] += cost[action[1]]
                position[rank] += 1
                progressed = True
        if not progressed:
            stuck = {r: a[position[r]] for r, a in orders.items() if position[r] < len(a)}
            raise ValueError(f"no rank can proceed; next actions: {stuck}")
    makespan = max(clock.values())
    return {"makespan": makespan, "idle_fraction": sum(makespan - b for b in busy.values()) / (len(orders) * makespan),
            "busy": busy}
