"""A training run's loss log, read back: the JSON lines the recipe (scripts/train/train.py, `--metrics FILE`) appends
on rank 0, one per step, `{"step", "loss", "lr", "grad_norm"}` (the loss is the mean over every data-parallel rank),
and `{"step", "eval_loss"}` after an evaluation.

Why a module: the log outlives a killed process, so it is the record of every attempt of a run that failed and
resumed; notebook 06 compares each attempt with an uninterrupted run. Splitting the lines into attempts is
bookkeeping, not the recipe.
"""
from __future__ import annotations

import json
import os


def records(path: str | os.PathLike) -> list[dict]:
    """The log's lines, in the order they were written."""
    with open(path) as log:
        return [json.loads(line) for line in log]


def attempts(path: str | os.PathLike) -> list[dict[int, float]]:
    """The training losses as attempts, `[{step: loss}, ...]`: a new attempt starts where the steps go back (a
    resumed run repeats the steps after its checkpoint). Evaluation lines are left out."""
    runs: list[dict[int, float]] = []
    for rec in records(path):
        if "loss" not in rec:
            continue
        if not runs or rec["step"] <= max(runs[-1]):
            runs.append({})
        runs[-1][rec["step"]] = rec["loss"]
    return runs
