"""The disk's own rates and the bytes a checkpoint holds: the ceiling a checkpoint's throughput is judged against.

Why: "DCP saved at X MB/s" means little alone. The same process, in the same run, writes a plain file of the same
size with `fsync` (what `FileSystemWriter(sync_files=True)`, DCP's default, waits for), and reads it back. A save
far below that rate is spending its time elsewhere (planning, pickling, collectives); one above it was not
waiting for the disk (fsync off, or a cache answering). Reads here are usually served from the page cache: the
read figure is a memory-copy ceiling, not a disk one, and the notebook says so.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

CHUNK = 8 << 20


def disk_write_rate(directory: str | os.PathLike, nbytes: int, repeats: int = 3) -> list[float]:
    """Bytes per second of writing `nbytes` to a new file in `directory` and fsyncing it, once per repeat."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    block = os.urandom(min(CHUNK, max(1, nbytes)))
    rates = []
    for i in range(repeats):
        path = directory / f".disk_probe_{os.getpid()}_{i}"
        start = time.perf_counter()
        with open(path, "wb") as f:
            left = nbytes
            while left > 0:
                n = min(left, len(block))
                f.write(block[:n])
                left -= n
            f.flush()
            os.fsync(f.fileno())
        rates.append(nbytes / (time.perf_counter() - start))
        path.unlink()
    return rates


def disk_read_rate(directory: str | os.PathLike, nbytes: int, repeats: int = 3) -> list[float]:
    """Bytes per second of reading back a file of `nbytes` just written (page cache, as a DCP load right after a
    save is)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f".disk_probe_read_{os.getpid()}"
    with open(path, "wb") as f:
        f.write(os.urandom(min(CHUNK, max(1, nbytes))) * (nbytes // CHUNK + 1))
    rates = []
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            with open(path, "rb") as f:
                while f.read(CHUNK):
                    pass
            rates.append(path.stat().st_size / (time.perf_counter() - start))
    finally:
        path.unlink()
    return rates


def directory_bytes(path: str | os.PathLike) -> int:
    """Total size of the files under `path` (a checkpoint folder)."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def state_bytes(state) -> int:
    """Bytes of the tensors this rank holds in a (nested) state dict: a DTensor counts its local shard only."""
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    return 0
