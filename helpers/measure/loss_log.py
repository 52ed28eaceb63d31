"""A training run's loss log, read back: the JSON lines each rank of notebook 06's recipe (scripts/dcp_resume.py)
appends per step, `{"step", "loss", "attempt", "time"}`.

Why a module: the log outlives a killed process, so it is the record of every attempt of a run that failed and
resumed; the notebook compares each attempt with an uninterrupted run and measures what a restart cost. Splitting
the lines into attempts and timing the gap between them is bookkeeping, not the recipe.
"""
from __future__ import annotations

import json
import os
from pathlib import Path


def records(run_dir: str | os.PathLike, rank: int = 0) -> list[dict]:
    """One rank's log lines, in the order they were written."""
    with open(Path(run_dir) / f"losses.rank{rank}.jsonl") as log:
        return [json.loads(line) for line in log]


def attempts(run_dir: str | os.PathLike, rank: int = 0) -> list[dict[int, float]]:
    """The log as attempts, `[{step: loss}, ...]`: a new attempt starts where the steps go back (a resumed run
    repeats the steps after its checkpoint)."""
    runs: list[dict[int, float]] = []
    for rec in records(run_dir, rank):
        if not runs or rec["step"] <= max(runs[-1]):
            runs.append({})
        runs[-1][rec["step"]] = rec["loss"]
    return runs


def restart_seconds(run_dir: str | os.PathLike, rank: int = 0) -> float:
    """Seconds from the last step logged by torchrun's attempt 0 to the first of attempt 1: failure detected,
    workers restarted, checkpoint loaded (the `attempt` field is TORCHELASTIC_RESTART_COUNT)."""
    recs = records(run_dir, rank)
    return min(r["time"] for r in recs if r["attempt"] == 1) - max(r["time"] for r in recs if r["attempt"] == 0)
