"""A training run's loss log, read back: the JSON lines the recipe (scripts/train/train.py, `--metrics FILE`) appends
on rank 0, one per step, `{"step", "loss", "lr", "grad_norm"}` (the loss is the mean over every data-parallel rank),
and `{"step", "eval_loss"}` after an evaluation.

Why a module: notebook 06 reads several runs' logs against an uninterrupted one. The recipe keeps each step once (a
resumed run drops the lines an attempt that died wrote past its checkpoint), so its log is one attempt; a log that
repeats steps (an older recipe's, or a script's that only appends) is split into attempts where the steps go back.
Reading the lines back is bookkeeping, not the recipe.
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
