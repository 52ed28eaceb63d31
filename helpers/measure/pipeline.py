"""A pipeline schedule's bubble, counted from the order of actions it really ran, and the bytes it keeps for backward.

Why count from the executed order: `torch.distributed.pipelining` schedules describe themselves in an IR
(`schedule.pipeline_order`, with `None` for idle slots), but for the single-stage schedules (`ScheduleGPipe`,
`Schedule1F1B`) that IR is only a drawing: their `step` runs its own loop, and in torch 2.13 the IR of
`Schedule1F1B` even names micro-batch 1 first on the last stage. What a schedule does is the sequence of
`forward_one_chunk` / `backward_one_chunk` (/ `backward_weight_one_chunk`) calls each stage makes, so
`record_actions` (notebook 08's cell, the recipe's scripts/train/pipeline.py) wraps those methods of a
`PipelineStage` and records (stage, 'F' or 'B', micro-batch, start, end) as they run ('I' and 'W' for the input and
weight halves of a backward the zero-bubble schedules split). `replay` then puts each rank's sequence on a clock
where every action takes one slot (or the costs given) and each action waits for the one it depends on (F of a
micro-batch on the previous stage, B on the next stage): the idle slots it counts are the schedule's bubble, to
compare with the closed form (p - 1)/(v·m + p - 1). The recorded times give the measured idle time.

The bytes a schedule keeps for backward are counted by `helpers.measure.activations.LiveSavedBytes` (the
activation memory that distinguishes GPipe, all m micro-batches in flight, from 1F1B, at most p - s on stage s).
"""
from __future__ import annotations

import statistics

import torch

Action = tuple  # (stage, kind 'F' or 'B', micro-batch)


def bubble_formula(stages: int, microbatches: int, chunks_per_rank: int = 1) -> float:
    """Idle fraction of a synchronous pipeline step with equal stages: (p - 1)/(v·m + p - 1), p = ranks."""
    p = stages // chunks_per_rank
    return (p - 1) / (chunks_per_rank * microbatches + p - 1)


def _ready(done: dict, stage: int, kind: str, mb: int, last_stage: int):
    """When the action's dependency finished (0.0 if it has none), or None if it has not run yet. F(s) waits for
    F(s-1); a backward of the input (B or I) for that of the next stage, or on the last stage for its own F; W for
    its own stage's I."""
    if kind == "F":
        return done.get((stage - 1, "F", mb)) if stage > 0 else 0.0
    if kind == "W":
        return done.get((stage, "I", mb))
    if stage == last_stage:
        return done.get((stage, "F", mb))
    after = done.get((stage + 1, "B", mb))
    return after if after is not None else done.get((stage + 1, "I", mb))


def replay(orders: dict[int, list[Action]], forward_cost: float = 1.0, backward_cost: float = 1.0) -> dict:
    """Run each rank's actions in its order on a shared clock, each waiting for what it depends on.

    orders: {rank: [(stage, 'F', 'B', 'I' or 'W', micro-batch), ...]} in the order the rank executed them.
    Dependencies: F(s, mb) after F(s-1, mb); B or I(s, mb) after B or I(s+1, mb), or after F(s, mb) on the last
    stage; W(s, mb) after I(s, mb). Costs: F `forward_cost`, B `backward_cost`, I and W half of it each (the zero
    bubble papers' T_F = T_B = T_W is forward_cost 1, backward_cost 2).
    Returns {'makespan', 'busy': {rank: time}, 'idle': {rank: time}, 'idle_fraction'}. Raises ValueError when no
    rank can proceed (an order that cannot run).
    """
    last_stage = max(a[0] for acts in orders.values() for a in acts)
    cost = {"F": forward_cost, "B": backward_cost, "I": backward_cost / 2, "W": backward_cost / 2}
    done: dict[Action, float] = {}
    clock = {r: 0.0 for r in orders}
    busy = {r: 0.0 for r in orders}
    position = {r: 0 for r in orders}
    remaining = sum(len(a) for a in orders.values())
    while remaining:
        progressed = False
        for r, acts in orders.items():
            while position[r] < len(acts):
                stage, kind, mb = acts[position[r]]
                ready = _ready(done, stage, kind, mb, last_stage)
                if ready is None:
                    break
                done[(stage, kind, mb)] = clock[r] = max(clock[r], ready) + cost[kind]
                busy[r] += cost[kind]
                position[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: acts[position[r]] for r, acts in orders.items() if position[r] < len(acts)}
            raise ValueError(f"no rank can proceed; next actions: {stuck}")
    makespan = max(clock.values())
    idle = {r: makespan - busy[r] for r in orders}
    return {"makespan": makespan, "busy": busy, "idle": idle,
            "idle_fraction": sum(idle.values()) / (len(orders) * makespan)}


def orders_from_log(logs: dict[int, list[tuple]]) -> dict[int, list[Action]]:
    """{rank: recorded (stage, kind, mb, start, end) tuples} -> {rank: [(stage, kind, mb)]} in execution order."""
    return {r: [(s, k, mb) for s, k, mb, *_ in sorted(log, key=lambda e: e[3])] for r, log in logs.items()}


def orders_from_ir(pipeline_order: dict[int, list]) -> dict[int, list[Action]]:
    """A schedule's own IR (`schedule.pipeline_order`: {rank: [action or None]}, actions printed like '0F1' or
    '1B0', '1I0', '0W0') -> {rank: [(stage, kind, mb)]}, keeping the compute actions (forwards, backwards and their
    input and weight halves), dropping idle slots and communication."""
    import re

    pattern = re.compile(r"^(\d+)(F|B|I|W)(\d+)$")
    orders = {}
    for rank, actions in pipeline_order.items():
        parsed = [pattern.match(str(a)) for a in actions if a is not None]
        orders[int(rank)] = [(int(m[1]), m[2], int(m[3])) for m in parsed if m]
    return orders


def step_seconds(logs: dict[int, list[tuple]]) -> float:
    """Wall time of one recorded step: first action's start to last action's end, over every rank."""
    events = [e for log in logs.values() for e in log]
    return max(e[4] for e in events) - min(e[3] for e in events)


def measured_idle_fraction(logs: dict[int, list[tuple]]) -> float:
    """1 - (time the ranks spent in forward/backward) / (ranks x the step's wall time, first start to last end)."""
    busy = sum(e[4] - e[3] for log in logs.values() for e in log)
    return 1.0 - busy / (len(logs) * step_seconds(logs))


def summarize_runs(results: list[dict], backward_cost: float = 1.0) -> list[dict]:
    """Per-rank results of a bubble sweep -> one row per (schedule, m), what the notebook prints, plots and asserts.

    results: one dict per rank, {'rank', 'runs': [{'schedule', 'm', 'stages' (this rank's stage indices), 'logs'
    (one `record_actions` log per measured step), 'peak_saved' (bytes), 'ir' ({rank: [str(action)]})}]}, the runs
    in the same order on every rank. Each row: schedule, m, p (ranks), v (stages per rank); 'orders' executed in
    the last step; 'counted' (its replayed idle fraction, a backward costing `backward_cost` forwards) beside
    'formula' (1F1B's); 'measured' idle fraction and 'step_s'
    (medians over the steps); 'events' {rank: [(start_s, end_s, 'F0')]} of the last step; 'peak_saved' {rank:
    bytes}; 'ir' (the schedule's own order, parsed)."""
    rows = []
    for i, run in enumerate(results[0]["runs"]):
        p, v, m = len(results), len(run["stages"]), run["m"]
        steps = [{r["rank"]: r["runs"][i]["logs"][k] for r in results} for k in range(len(run["logs"]))]
        orders = orders_from_log(steps[-1])
        rows.append({
            "schedule": run["schedule"], "m": m, "p": p, "v": v, "orders": orders,
            "counted": replay(orders, backward_cost=backward_cost)["idle_fraction"],
            "formula": bubble_formula(p * v, m, v),
            "measured": statistics.median(measured_idle_fraction(s) for s in steps),
            "step_s": statistics.median(step_seconds(s) for s in steps),
            "events": {rank: [(e[3], e[4], f"{e[1]}{e[2]}") for e in sorted(log, key=lambda e: e[3])]
                       for rank, log in steps[-1].items()},
            "peak_saved": {r["rank"]: r["runs"][i]["peak_saved"] for r in results},
            "ir": orders_from_ir(run["ir"]), "backward_cost": backward_cost,
        })
    return rows


def ir_report(row: dict) -> str:
    """Whether a schedule's own IR (`pipeline_order`) is the order it executed, what the IR replays to, and where
    they differ, as lines to print."""
    try:
        fraction = replay(row["ir"], backward_cost=row.get("backward_cost", 1.0))["idle_fraction"]
        replayed = f"replays to {fraction:.4f}"
    except ValueError as exc:
        replayed = f"cannot be replayed ({exc})"
    differ = [r for r in row["orders"] if row["ir"].get(r) != row["orders"][r]]
    lines = [f"{row['schedule']:<12} IR {'differs on ranks ' + str(differ) if differ else 'matches the executed order'}"
             f"; it {replayed}"]
    for r in differ:
        lines += [f"  rank {r} IR:       " + " ".join(f"{k}{mb}" for _, k, mb in row["ir"].get(r, [])),
                  f"  rank {r} executed: " + " ".join(f"{k}{mb}" for _, k, mb in row["orders"][r])]
    return "\n".join(lines)


def bubble_table(rows: list[dict]) -> str:
    """Each (schedule, m)'s idle fraction of a step three ways: counted from the order the schedule executed,
    the formula (p - 1)/(v·m + p - 1), and measured from the recorded times. rows: `summarize_runs` rows."""
    lines = [f"p = {rows[0]['p']} ranks; idle fraction of a step (counted from the executed order | formula | "
             "measured here)"]
    lines += [f"{row['schedule']:<12} m = {row['m']:>2}: {row['counted']:.4f} | {row['formula']:.4f} | "
              f"{row['measured']:.3f}" for row in rows]
    return "\n".join(lines)


def peaks_table(rows: list[dict], schedules: tuple[str, ...]) -> str:
    """Peak bytes saved for backward per stage (rank s) and schedule, one line per m, '-' where a schedule did
    not run at that m. rows: `summarize_runs` rows."""
    peak = {(row["schedule"], row["m"], s): b for row in rows for s, b in row["peak_saved"].items()}
    ranks = sorted({s for _, _, s in peak})
    lines = ["peak bytes saved for backward, per rank (= stage s)",
             f"{'m':>3} " + " ".join(f"{f'{name} s={s}':>14}" for s in ranks for name in schedules)]
    for m in sorted({m for _, m, _ in peak}):
        lines.append(f"{m:>3} " + " ".join(f"{format(peak[(n, m, s)], ',') if (n, m, s) in peak else '-':>14}"
                                           for s in ranks for n in schedules))
    return "\n".join(lines)
