"""Commit checkpoints atomically, keep the last k, and find the latest complete one.

Why: a checkpoint is many files written by many ranks. Written in place over the previous one (a fixed "latest"
folder), a crash half-way leaves the old `.metadata` beside a mix of old and new shard files: the "latest"
checkpoint then fails to load, or, worse, loads a state that never existed. The protocol here:

1. every rank saves into a staging folder (`.step_00000120.partial`), which no reader ever picks;
2. once the save has finished on every rank, one rank renames it to `step_00000120` (a rename within one file
   system is atomic: readers see the old set of folders or the new one, never half of it) and fsyncs the parent
   folder so the rename itself survives a power cut;
3. then, and only then, older committed folders beyond the newest `keep` are deleted.

A reader takes the highest committed step. DCP itself writes `.metadata` last (through a temporary file and a
rename), so a committed folder always has one; `committed_steps` checks for it anyway.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

_COMMITTED = re.compile(r"^step_(\d{8})$")
METADATA = ".metadata"


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """Where the committed checkpoint of `step` lives."""
    return Path(root) / f"step_{step:08d}"


def staging_dir(root: str | os.PathLike, step: int) -> Path:
    """Where the checkpoint of `step` is written before it is committed (never read by `latest`)."""
    return Path(root) / f".step_{step:08d}.partial"


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries (a rename, a new file) durable, not only the files' contents."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def committed_steps(root: str | os.PathLike) -> list[int]:
    """Steps with a committed, complete checkpoint under `root`, ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        match = _COMMITTED.match(entry.name)
        if match and entry.is_dir() and (entry / METADATA).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest(root: str | os.PathLike) -> Path | None:
    """The newest committed checkpoint folder, or None when there is none yet."""
    steps = committed_steps(root)
    return step_dir(root, steps[-1]) if steps else None


def commit(root: str | os.PathLike, step: int, keep: int | None = None) -> Path:
    """Publish the staged checkpoint of `step` (call once, on one rank, after every rank finished saving).

    Refuses a staging folder without `.metadata` (the save did not finish) and an already committed step.
    """
    staged, final = staging_dir(root, step), step_dir(root, step)
    if not (staged / METADATA).is_file():
        raise FileNotFoundError(f"{staged} has no {METADATA}: the save of step {step} did not finish")
    if final.exists():
        raise FileExistsError(f"step {step} is already committed at {final}")
    os.rename(staged, final)
    fsync_dir(root)
    if keep is not None:
        prune(root, keep)
    return final


def prune(root: str | os.PathLike, keep: int) -> list[int]:
    """Delete committed checkpoints older than the newest `keep`; returns the steps deleted."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    steps = committed_steps(root)
    doomed = steps[:-keep]
    for step in doomed:
        shutil.rmtree(step_dir(root, step))
    if doomed:
        fsync_dir(root)
    return doomed


def clear_staging(root: str | os.PathLike) -> list[Path]:
    """Remove staging folders left by crashed saves (call before training resumes, on one rank)."""
    root = Path(root)
    if not root.is_dir():
        return []
    stale = [p for p in root.iterdir() if p.name.startswith(".step_") and p.name.endswith(".partial")]
    for p in stale:
        shutil.rmtree(p)
    return stale
