"""Holding notebook 10's runs of the training recipe against the planner (scripts/train/plan.py): what a run's
collective log adds up to per kind, which of its collectives the planner leaves out on purpose, and the ceilings a
step-time estimate is made from.

Why a module: the notebook's worker runs the recipe and returns plain records; turning those into comparable
totals is bookkeeping that would bury the comparison the notebook is about. Nothing here plans or runs anything.
"""
from __future__ import annotations

import statistics


def totals(calls: list[tuple]) -> dict[str, dict[str, int]]:
    """{kind: {'calls', 'bytes'}} of a run's collectives, given as (kind, numel, itemsize, group_size) tuples;
    calls on groups of one rank move nothing and are left out, and so are receives (the planner counts a
    message once, where it is sent)."""
    out: dict[str, dict[str, int]] = {}
    for kind, numel, itemsize, group_size in calls:
        if group_size <= 1 or kind == "recv":
            continue
        entry = out.setdefault(kind, {"calls": 0, "bytes": 0})
        entry["calls"] += 1
        entry["bytes"] += numel * itemsize
    return out


def planned_totals(records: list[dict]) -> dict[str, dict[str, int]]:
    """The planner's collective records of a step as {kind: {'calls', 'bytes'}}."""
    out: dict[str, dict[str, int]] = {}
    for r in records:
        entry = out.setdefault(r["kind"], {"calls": 0, "bytes": 0})
        entry["calls"] += r["calls"]
        entry["bytes"] += int(r["buffer_bytes"])
    return out


def split_norm_weight_reductions(calls: list[tuple], dim: int, tp: int) -> tuple[list[tuple], list[tuple]]:
    """(planned, left out): under tensor parallelism the norm weights' gradients stay partial sums over the tp
    group and are all-reduced wherever they are read (clipping, each read of the optimizer), `dim` fp32 elements
    each time. The planner does not count these; they are the all-reduces of exactly `dim` elements over the tp
    group. Without tp nothing is left out."""
    if tp <= 1:
        return list(calls), []
    left = [c for c in calls if c[0] == "all_reduce" and c[1] == dim and c[3] == tp]
    return [c for c in calls if not (c[0] == "all_reduce" and c[1] == dim and c[3] == tp)], left


def sweep_ceilings(records: list[dict], ceilings: dict | None) -> dict:
    """From a collective sweep's result (records of `collectives.time_collective`, the ceilings of `ceilings.measure_ceilings`): bus bandwidth (median busbw of the largest size, all-gather and
    reduce-scatter and all-reduce together), latency (median time of the smallest all-reduce) and the memory copy
    rate of the host (its ceiling record), as plain numbers."""
    largest = max(r["size_bytes"] for r in records)
    busbw = statistics.median(r["busbw"] for r in records if r["size_bytes"] == largest)
    smallest = min(r["size_bytes"] for r in records)
    latency = statistics.median(r["median_s"] for r in records
                                if r["size_bytes"] == smallest and r["collective"] == "all_reduce")
    copy = ceilings["memcpy"]["rate"] if ceilings else None
    return {"busbw": busbw, "latency": latency, "copy": copy, "size_bytes": largest,
            "world_size": records[0]["world_size"], "backend": records[0]["backend"]}
