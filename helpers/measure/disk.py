"""A checkpoint's cost against the disk it lands on: the disk's own fsync'd write rate, a DCP save, an async save,
a load, all measured in one run on the same state.

Why: "DCP saved at X MB/s" means little alone. The same processes, in the same run, write plain files of the same
size with `fsync` (what `FileSystemWriter(sync_files=True)`, DCP's default, waits for). A save far below that rate
spends its time elsewhere (planning, pickling, collectives); one far above it was not waiting for the disk (fsync
off, or a cache answering). Fixed costs (planning, metadata, the collectives) dominate a small state, so the state
measured must be large (hundreds of MB on a GPU) for the ratio to say anything about the writing.

The worker that times the saves is notebook 06's (`save_costs` in its cells, plain PyTorch, on the training
recipe's state); this module only summarises what its ranks return and lays out a checkpoint folder (it launches
nothing: the notebook launches its workers itself).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch


def directory_bytes(path: str | os.PathLike) -> int:
    """Total size of the files under `path` (a checkpoint folder)."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def bench_ranks(world_size: int, gpus: int) -> int:
    """Ranks for the save-throughput measurement: one per GPU wherever there are GPUs (at most `world_size`), else
    `world_size` CPU ranks.

    Why not the notebook's world size: on a one-GPU machine the notebook's demos run 2 CPU ranks, yet the figure
    worth taking there is a save of CUDA state (its async staging is a device-to-host copy) of hundreds of MB,
    which one rank on the GPU measures. Taking `gpus` as an argument lets a CPU test drive the GPU decision.
    """
    return min(world_size, gpus) or world_size


DISK = "disk write + fsync"


def summarize_costs(results: list[dict]) -> dict:
    """Per operation the slowest rank's seconds per repeat (training waits for it) and their median; ratios taken
    side by side in each repeat, with their median and spread (min, max):

    - `save_vs_disk[op]` for each synchronous save `op` ("dcp.save..."): the disk's fsync'd write time over the
      save's (1 = the save runs at the disk's speed),
    - `blocking_share[op]` for each async save's blocking part `op` ("... (blocking)"): how long it blocked the
      caller, over the default synchronous save's time.

    `results` are the ranks' returns of notebook 06's `save_costs` worker: {"times": {op: [seconds per repeat]},
    "held_bytes", "on_disk", "device"}. Where the state lived (`device`, rank 0's) and how many ranks held it
    (`world_size`) stay beside the figures.
    """
    import statistics

    ops = list(results[0]["times"])
    slowest = {op: [max(r["times"][op][i] for r in results) for i in range(len(results[0]["times"][op]))]
               for op in ops}

    def spread(values):
        return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}

    total = sum(r["held_bytes"] for r in results)
    return {"state_bytes": total, "on_disk": results[0]["on_disk"], "seconds": slowest,
            "device": results[0]["device"], "world_size": len(results),
            "median_s": {op: statistics.median(v) for op, v in slowest.items()},
            "rate": {op: total / statistics.median(v) for op, v in slowest.items()},
            "save_vs_disk": {op: spread([d / s for d, s in zip(slowest[DISK], slowest[op])])
                             for op in ops if op.startswith("dcp.save")},
            "blocking_share": {op: spread([b / s for b, s in zip(slowest[op], slowest["dcp.save"])])
                               for op in ops if op.endswith("(blocking)")}}


def ratios_text(summary: dict) -> str:
    """The ratios of `summarize_costs` as lines: median and (min-max) over the repeats."""
    lines = [f"  {op + ': rate / disk rate':<58} {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})"
             for op, r in summary["save_vs_disk"].items()]
    lines += [f"  {op + ' / dcp.save time':<58} {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})"
              for op, r in summary["blocking_share"].items()]
    return "median (min-max) over the repeats, slowest rank:\n" + "\n".join(lines)


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
    lines.append(f"\n{len(keys)} keys, e.g. {[k for k in keys if '.optim.' not in k][-6:]}")
    lines.append(f"tensors (global shapes) {layout['tensor_bytes']:,} bytes; data files {layout['file_bytes']:,} "
                 f"({layout['file_bytes'] / layout['tensor_bytes']:.3f}x)")
    return "\n".join(lines)


def costs_table(summary: dict, repeats: int, cores: int) -> str:
    """`summarize_costs`'s medians and rates as a table, with a warning where the ranks outnumber the cores."""
    device, world_size = summary["device"], summary["world_size"]
    lines = [f"{summary['state_bytes'] / 2 ** 20:.0f} MiB of tensors over {world_size} rank(s) on {device}, "
             f"{summary['on_disk'] / 2 ** 20:.0f} MiB on disk; {repeats} repeats, slowest rank"]
    lines.append(f"  {'':<44} median (min-max of the repeats), rate at the median")
    lines += [f"  {op:<44} {t * 1e3:9.1f} ms ({min(summary['seconds'][op]) * 1e3:.1f}-"
              f"{max(summary['seconds'][op]) * 1e3:.1f})  {summary['rate'][op] / 2 ** 20:7.0f} MiB/s"
              for op, t in summary["median_s"].items()]
    if world_size > cores:
        lines.append(f"WARNING: {world_size} ranks on {cores} cores: the rates measure the scheduler as much as the disk")
    return "\n".join(lines)


def record_headlines(summary: dict) -> None:
    """`summarize_costs`' ratios as headline figures (`helpers.headline`), which the run summary table collects
    across notebooks and machines. Why here: the names and units must stay the same from run to run, so they are
    written once, beside the summary that computes them. The default save and async save keep their names; each
    tuned variant adds its own."""
    from helpers.measure.headline import headline
    for op, r in summary["save_vs_disk"].items():
        name = "" if op == "dcp.save" else op.removeprefix("dcp.save")
        headline(f"dcp.save{name} throughput / disk write+fsync rate", r["median"], "x")
    for op, r in summary["blocking_share"].items():
        name = op.removeprefix("async_save").removesuffix(" (blocking)")
        name = "" if name == ", default stager" else name
        headline(f"async_save{name} blocking / sync save time", r["median"], "x")


def whole_checkpoint(folder: str | os.PathLike, file: str | os.PathLike) -> dict:
    """A DCP folder read whole by one process: `dcp_to_torch_save(folder, file)`, then `torch.load(file)`.

    Why here: notebook 06 compares whole checkpoints of several runs (resumed against uninterrupted, written at one
    world size against loaded at another), optimizer state included, which the recipe's `export` (the model alone)
    leaves out; the two calls per comparison are plumbing, not the lesson."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(folder, file)
    return torch.load(file)
