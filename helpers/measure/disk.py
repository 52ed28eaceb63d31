"""A checkpoint's cost against the disk it lands on: the disk's own fsync'd write rate, a DCP save, an async save,
a load, all measured in one run on the same state.

Why: "DCP saved at X MB/s" means little alone. The same processes, in the same run, write plain files of the same
size with `fsync` (what `FileSystemWriter(sync_files=True)`, DCP's default, waits for). A save far below that rate
spends its time elsewhere (planning, pickling, collectives); one far above it was not waiting for the disk (fsync
off, or a cache answering). Fixed costs (planning, metadata, the collectives) dominate a small state, so the state
measured must be large (hundreds of MB on a GPU) for the ratio to say anything about the writing.

`checkpoint_costs` is the harness a notebook launches on every rank: it owns the process group and the timing
loop, and takes the plain recipe (`make_state(device)`, which builds the model, optimizer and the Stateful app
state on this rank's device) from outside, so the recipe stays free of measuring code. Byte counting of local shards is `helpers.measure.memory`'s.
"""
from __future__ import annotations

import gc
import os
import shutil
import time
from pathlib import Path

import torch

from helpers.measure.claims import median_interval
from helpers.measure.memory import tensor_bytes

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


def directory_bytes(path: str | os.PathLike) -> int:
    """Total size of the files under `path` (a checkpoint folder)."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def state_bytes(state) -> int:
    """Bytes of the tensors this rank holds in a (nested) state dict; a Stateful counts its `state_dict()`, and a
    DTensor its local shard only (`memory.tensor_bytes`)."""
    if isinstance(state, torch.Tensor):
        return tensor_bytes(state)
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    if callable(getattr(state, "state_dict", None)):
        return state_bytes(state.state_dict())
    return 0


def bench_ranks(world_size: int, gpus: int) -> int:
    """Ranks for the save-throughput measurement: one per GPU wherever there are GPUs (at most `world_size`), else
    `world_size` CPU ranks.

    Why not the notebook's world size: on a one-GPU machine the notebook's demos run 2 CPU ranks, yet the figure
    worth taking there is a save of CUDA state (its async staging is a device-to-host copy) of hundreds of MB,
    which one rank on the GPU measures. Taking `gpus` as an argument lets a CPU test drive the GPU decision.
    """
    return min(world_size, gpus) or world_size


OPS = ("disk write + fsync", "dcp.save", "async_save (blocking)", "async_save (until written)", "dcp.load")


def checkpoint_costs(make_state, root: str, repeats: int = 3) -> dict:
    """Launch on every rank: seconds of each of `OPS` per repeat for the state `make_state(device)` builds.

    The process group is "cpu:gloo,cuda:nccl" on GPUs (DCP's collectives on the CPU side, training's on NCCL)
    with `device_id`, else gloo. async_save gets its own gloo group: its collectives run in a background thread and
    must never interleave with the training loop's on the default group. Repeats interleave the operations, so a
    busy neighbour slows them alike; each rank writes as many disk bytes as it holds tensor bytes, at the same
    time as the others. Returns plain values.
    """
    import torch.distributed as dist

    from helpers.devices import default_backend, rank_device

    device = rank_device()
    if default_backend() == "nccl":
        torch.cuda.set_device(device)  # DCP plans with object collectives, which use the current device
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    try:
        return _costs(make_state, device, Path(root), repeats)
    finally:
        gc.collect()
        dist.destroy_process_group()


def _costs(make_state, device, root: Path, repeats: int) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from helpers.measure.timing import timed

    rank = dist.get_rank()
    state = make_state(device)
    async_group = dist.new_group(backend="gloo")
    nbytes = state_bytes(state)
    times = {op: [] for op in OPS}
    on_disk = None
    for i in range(repeats):
        sync_dir, async_dir = str(root / f"sync{i}"), str(root / f"async{i}")
        _, t = timed(lambda: disk_write_rate(root / f"disk{rank}", nbytes, repeats=1), device)
        times["disk write + fsync"].append(t)
        _, t = timed(lambda: dcp.save(state, checkpoint_id=sync_dir), device)
        times["dcp.save"].append(t)
        future, t = timed(lambda: dcp.async_save(state, checkpoint_id=async_dir, process_group=async_group), device)
        times["async_save (blocking)"].append(t)
        start = time.perf_counter()
        future.result()  # at most one save in flight
        times["async_save (until written)"].append(t + time.perf_counter() - start)
        _, t = timed(lambda: dcp.load(state, checkpoint_id=sync_dir), device)
        times["dcp.load"].append(t)
        dist.barrier()
        if rank == 0:
            on_disk = on_disk or directory_bytes(sync_dir)
            shutil.rmtree(sync_dir)
            shutil.rmtree(async_dir)
    return {"times": times, "held_bytes": nbytes, "on_disk": on_disk, "device": str(device)}


def summarize_costs(results: list[dict]) -> dict:
    """Per operation the slowest rank's seconds per repeat (training waits for it) and their median; the two ratios
    taken side by side in each repeat, with the median and a bootstrap interval of it:

    - `save_vs_disk`: dcp.save's rate over the disk's fsync'd write rate (1 = the save runs at the disk's speed),
    - `blocking_share`: how long async_save blocked the caller, over a synchronous save's time.

    It keeps where the state lived (`device`, rank 0's) and how many ranks held it (`world_size`) beside the figures.
    """
    import statistics

    slowest = {op: [max(r["times"][op][i] for r in results) for i in range(len(results[0]["times"][op]))]
               for op in OPS}
    ratios = {"save_vs_disk": [d / s for d, s in zip(slowest["disk write + fsync"], slowest["dcp.save"])],
              "blocking_share": [b / s for b, s in zip(slowest["async_save (blocking)"], slowest["dcp.save"])]}
    total = sum(r["held_bytes"] for r in results)
    return {"state_bytes": total, "on_disk": results[0]["on_disk"], "seconds": slowest,
            "device": results[0]["device"], "world_size": len(results),
            "median_s": {op: statistics.median(v) for op, v in slowest.items()},
            "rate": {op: total / statistics.median(v) for op, v in slowest.items()},
            "ratios": {k: {"median": statistics.median(v), "interval": median_interval(v), "values": v}
                       for k, v in ratios.items()}}


def checkpoint_layout(folder: str | os.PathLike, metadata, name: str) -> dict:
    """What a DCP folder holds, read from its `.metadata` (`dcp.FileSystemReader(folder).read_metadata()`): each
    file's size, the chunks of tensor `name` (offset, size, the file holding it), every key, and the bytes of all
    tensors at their global shapes beside those of the data files, so a notebook can assert that every tensor was
    written once, and show how the metadata makes resharding possible."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = Path(folder)
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir())}
    chunks = [{"offsets": tuple(c.offsets), "sizes": tuple(c.sizes),
               "file": next(info.relative_path for index, info in metadata.storage_data.items()
                            if index.fqn == name and tuple(index.offset) == tuple(c.offsets))}
              for c in metadata.state_dict_metadata[name].chunks]
    tensors = sum(m.size.numel() * m.properties.dtype.itemsize for m in metadata.state_dict_metadata.values()
                  if isinstance(m, TensorStorageMetadata))
    return {"files": files, "name": name, "shape": tuple(metadata.state_dict_metadata[name].size), "chunks": chunks,
            "keys": sorted(metadata.state_dict_metadata), "tensor_bytes": tensors,
            "file_bytes": sum(n for f, n in files.items() if f.endswith(".distcp"))}


def layout_text(layout: dict) -> str:
    """`checkpoint_layout` as lines to print: the files, the chunks of one tensor, a few keys, the byte totals."""
    lines = [f"{f:<16} {n:>10,} bytes" for f, n in layout["files"].items()]
    lines.append(f"\n{layout['name']}: global shape {layout['shape']}; chunks (offset, size) and file:")
    lines += [f"   {c['offsets']}  {c['sizes']}  -> {c['file']}" for c in layout["chunks"]]
    keys = layout["keys"]
    lines.append(f"\n{len(keys)} keys, e.g. {[k for k in keys if not k.startswith('app.optim')][-6:]}")
    lines.append(f"tensors (global shapes) {layout['tensor_bytes']:,} bytes; data files {layout['file_bytes']:,} "
                 f"({layout['file_bytes'] / layout['tensor_bytes']:.3f}x)")
    return "\n".join(lines)


def costs_table(summary: dict, repeats: int, cores: int) -> str:
    """`summarize_costs`'s medians and rates as a table, with a warning where the ranks outnumber the cores."""
    device, world_size = summary["device"], summary["world_size"]
    lines = [f"{summary['state_bytes'] / 2 ** 20:.0f} MiB of tensors over {world_size} rank(s) on {device}, "
             f"{summary['on_disk'] / 2 ** 20:.0f} MiB on disk; {repeats} repeats, slowest rank"]
    lines.append(f"  {'':<28} median (min-max of the repeats), rate at the median")
    lines += [f"  {op:<28} {t * 1e3:9.1f} ms ({min(summary['seconds'][op]) * 1e3:.1f}-"
              f"{max(summary['seconds'][op]) * 1e3:.1f})  {summary['rate'][op] / 2 ** 20:7.0f} MiB/s"
              for op, t in summary["median_s"].items()]
    if world_size > cores:
        lines.append(f"WARNING: {world_size} ranks on {cores} cores: the rates measure the scheduler as much as the disk")
    return "\n".join(lines)


def record_headlines(summary: dict) -> None:
    """`summarize_costs`' two ratios as headline figures (`helpers.headline`), which the run summary table collects
    across notebooks and machines. Why here: the names and units must stay the same from run to run, so they are
    written once, beside the summary that computes them."""
    from helpers.measure.headline import headline
    headline("dcp.save throughput / disk write+fsync rate", summary["ratios"]["save_vs_disk"]["median"], "x")
    headline("async_save blocking / sync save time", summary["ratios"]["blocking_share"]["median"], "x")


def whole_checkpoint(folder: str | os.PathLike, file: str | os.PathLike) -> dict:
    """A DCP folder read whole by one process: `dcp_to_torch_save(folder, file)`, then `torch.load(file)`.

    Why here: notebook 06 shows that conversion once, then compares whole checkpoints of several runs (resumed
    against uninterrupted, written at one world size against loaded at another); the two calls per comparison are
    plumbing, not the lesson."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(folder, file)
    return torch.load(file)


def crash_then_load(save, load, root: Path, newest, *args, world_size: int, timeout: float, env=None) -> dict:
    """Launch `save(str(root), *args)` on `world_size` ranks, a save meant to die part-way, then `load` on one
    process on `newest(root)` (the folder a resuming run would pick). Returns what `load` returned, or
    `{"error": message}` when the checkpoint did not even load, with the two states the save kept aside where no
    crash can take them (`root/state_A.pt`, `root/state_B.pt`) under "A" and "B".

    Why here: notebook 06 runs this twice (saving in place, saving with the commit protocol); the launches, the
    expected failures and the bookkeeping are plumbing, the crashing writer and the verdict on what loaded stay in
    the notebook."""
    from helpers.launcher import WorkerError, launch
    root.mkdir()
    try:
        launch(save, str(root), *args, world_size=world_size, timeout=timeout, env=env, quiet=True)
    except WorkerError as failure:
        print(f"{root.name}: the save of B crashed ({failure.message}, rank {failure.rank})")
    try:  # the newest checkpoint, loaded (and resharded) by one process
        newest_state = launch(load, str(newest(root)), world_size=1, timeout=timeout, quiet=True)[0]
    except WorkerError as failure:  # a torn checkpoint may also fail to load at all
        newest_state = {"error": failure.message}
    return {"A": torch.load(root / "state_A.pt"), "B": torch.load(root / "state_B.pt"), **newest_state}
