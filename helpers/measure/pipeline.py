"""The records of a pipeline schedule's actions turned into rows to print and plot: the order each rank ran, the
idle time measured on the clock, the schedule's own IR beside it, the bytes kept for backward.

Why from the executed order: `torch.distributed.pipelining` schedules describe themselves in an IR
(`schedule.pipeline_order`, with `None` for idle slots), but for the single-stage schedules (`ScheduleGPipe`,
`Schedule1F1B`) that IR is only a drawing: their `step` runs its own loop, and in torch 2.13 the IR of
`Schedule1F1B` even names micro-batch 1 first on the last stage. What a schedule does is the sequence of
`forward_one_chunk` / `backward_one_chunk` (/ `backward_weight_one_chunk`) calls each stage makes, which
`record_actions` records as (stage, 'F' or 'B', micro-batch, start, end) ('I' and 'W' for the input and weight
halves of a backward the zero-bubble schedules split). Counting the bubble from that order is the lesson, and lives
in notebook 08's cells (the recipe's scripts/train/pipeline.py: `record_actions`, `depends_on`, `replay`,
`bubble_formula`); this module only tabulates what the ranks sent back.

The bytes a schedule keeps for backward are counted by `helpers.measure.activations.LiveSavedBytes` (the
activation memory that distinguishes GPipe, all m micro-batches in flight, from 1F1B, at most p - s on stage s).
"""
from __future__ import annotations

import statistics
from typing import Callable

Action = tuple  # (stage, kind 'F', 'B', 'I' or 'W', micro-batch)


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


def summarize_runs(results: list[dict]) -> list[dict]:
    """Per-rank results of a bubble sweep -> one row per (schedule, m), to count, print and plot.

    results: one dict per rank, {'rank', 'runs': [{'schedule', 'm', 'stages' (this rank's stage indices), 'logs'
    (one `record_actions` log per measured step), 'peak_saved' (bytes), 'ir' ({rank: [str(action)]})}]}, the runs
    in the same order on every rank. Each row: schedule, m, p (ranks), v (stages per rank); 'orders' executed in
    the last step ({rank: [(stage, kind, mb)]}, what notebook 08's `replay` counts); 'measured' idle fraction and
    'step_s' (medians over the steps); 'events' {rank: [(start_s, end_s, 'F0')]} of the last step; 'peak_saved'
    {rank: bytes}; 'ir' (the schedule's own order, parsed)."""
    rows = []
    for i, run in enumerate(results[0]["runs"]):
        steps = [{r["rank"]: r["runs"][i]["logs"][k] for r in results} for k in range(len(run["logs"]))]
        rows.append({
            "schedule": run["schedule"], "m": run["m"], "p": len(results), "v": len(run["stages"]),
            "orders": orders_from_log(steps[-1]),
            "measured": statistics.median(measured_idle_fraction(s) for s in steps),
            "step_s": statistics.median(step_seconds(s) for s in steps),
            "events": {rank: [(e[3], e[4], f"{e[1]}{e[2]}") for e in sorted(log, key=lambda e: e[3])]
                       for rank, log in steps[-1].items()},
            "peak_saved": {r["rank"]: r["runs"][i]["peak_saved"] for r in results},
            "ir": orders_from_ir(run["ir"]),
        })
    return rows


def ir_report(row: dict, count: Callable[[dict], float]) -> str:
    """Whether a schedule's own IR (`pipeline_order`) is the order it executed, the idle fraction `count` gives the
    IR (notebook 08's replay: ValueError for an order that cannot run), and where they differ, as lines to print."""
    try:
        replayed = f"replays to {count(row['ir']):.4f}"
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
    """Each (schedule, m)'s idle fraction of a step three ways: 'counted' from the order the schedule executed,
    the 'formula' (p - 1)/(v·m + p - 1), and 'measured' from the recorded times. rows: `summarize_runs` rows with
    the first two added (notebook 08's cells count them)."""
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
