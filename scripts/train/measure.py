# From the PyTorch distributed cookbook: the cells tagged 'script:train/measure.py' in
#   notebooks/09_from_notebook_to_cluster.ipynb
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
"""What a training run measures and records, apart from the training itself: the log line's window (its time, with
evaluation and checkpoints set aside, and the peak memory), tokens/s and MFU, the mean loss over the replicas, the
--metrics file (each step once), and what --tensorboard, --profile-steps and --memory-snapshot write.

    meter = Meter(tokens_per_step, flops_per_token, steps, device, dtype)   # collective: measures the matmul peak
    with meter.set_aside("eval"):
        ...                                    # not training time: shown apart, counted in neither tokens/s nor MFU
    meter.report(rank, step, loss, lr, norm)   # collective: the log line over the steps since the last one
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import hardware
from float8 import float8_datasheet_peak

SNAPSHOT_STEPS = 3         # --memory-snapshot records through this many steps: where the peak is reached


def log(rank: int, message: str) -> None:
    if rank == 0:
        print(message, flush=True)


def replica_mean(value: torch.Tensor, counted: bool, replicas: int) -> float:
    """The mean over the data-parallel replicas of a value that every rank `counted` holds (the tp peers of a
    replica and the other pipeline stages pass counted=False): one all-reduce over the whole world, each replica
    counted once. One process takes part in no collective."""
    if dist.get_world_size() == 1:
        return value.detach().float().item()
    total = (value.detach().float() if counted else torch.zeros((), device=value.device)) / replicas
    total = total.reshape(1).clone()
    dist.all_reduce(total)
    return total.item()


def reset_peak_memory(device: torch.device) -> bool:
    """Start a window of peak memory: CUDA's allocator peaks; on a CPU the process's peak resident set (Linux:
    writing 5 to /proc/self/clear_refs resets VmHWM). False where it cannot be reset (the peak then runs from the
    process's start)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_memory(device: torch.device) -> tuple[int, int | None]:
    """(peak, peak reserved) bytes since `reset_peak_memory`. CUDA: the caching allocator's tensors, and what it
    held from the driver (reserved: what an out-of-memory error counts). CPU: the process's peak resident set,
    everything it holds (tensors, Python, libraries), nothing reserved apart."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    try:
        return int(re.search(r"^VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)[1]) * 1024, None
    except (OSError, TypeError):
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return (rss if sys.platform == "darwin" else rss * 1024), None


def open_metrics(path: str | Path, start_step: int):
    """The --metrics file, opened to append (rank 0), holding each step once: the lines past `start_step` (what an
    attempt that died wrote after the checkpoint this run resumes from, or a run's own final evaluation when it is
    run again) are dropped first, the rest rewritten by a rename."""
    path, kept = Path(path), []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except ValueError:                      # a line cut short by a kill
            continue
        if record.get("step", 0) < start_step or (record.get("step") == start_step and not record.get("final")):
            kept.append(line + "\n")
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text("".join(kept))
    os.replace(partial, path)
    return open(path, "a", buffering=1)


def write_metrics(metrics, **values) -> None:
    """One JSON line in the --metrics file (open on rank 0 only: None elsewhere)."""
    if metrics:
        print(json.dumps(values), file=metrics)


class Window:
    """The steps since the last log line: their time less what was set aside (evaluation and checkpoints, shown
    apart, so that tokens/s and MFU are the training's), and this rank's peak memory over them."""

    def __init__(self, device: torch.device):
        self.device = device
        self.totals = {"eval": 0.0, "checkpoint": 0.0}          # seconds set aside over the whole run
        self.restart()

    def restart(self) -> float:
        """A new window of steps; returns its start (time.perf_counter)."""
        self.aside = dict.fromkeys(self.totals, 0.0)
        self.windowed = reset_peak_memory(self.device)          # False: the peak runs from the start
        self.start, self.steps = time.perf_counter(), 0
        return self.start

    @contextlib.contextmanager
    def set_aside(self, what: str):
        """The time spent inside is not training time: the log line shows it apart."""
        start = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            self.aside[what] += spent
            self.totals[what] += spent

    def training_seconds(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self.start - sum(self.aside.values())


class Meter(Window):
    """The log line's figures over a window: tokens/s, MFU, the largest peak memory of any rank. MFU is against
    the datasheet's dense peak of every rank's accelerator in the training dtype (hardware.py: the convention
    published figures use); the matmul rate the ranks measured at the start (their sum) is the second figure, and
    on a CPU, which has no datasheet row, the only one. One process takes part in no collective."""

    def __init__(self, tokens_per_step: int, flops_per_token: int, steps: int, device: torch.device,
                 dtype: torch.dtype, float8_share: float = 0.0):
        self.world = dist.get_world_size()
        measured = torch.tensor([hardware.measured_matmul_peak(device, dtype)], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(measured)                           # the world's: the sum of the ranks'
        self.measured_peak = measured.item()
        column, name = hardware.matmul_dtype_name(dtype), torch.cuda.get_device_name(device) if device.type == \
            "cuda" else None
        sheet = name and (float8_datasheet_peak(name, column, float8_share) if float8_share else
                          hardware.datasheet_peak(name, column))
        if sheet:           # --float8: its linears' share of the FLOPs against the float8 peak, the rest the column's
            self.peak = sheet[0] * self.world
            self.peak_source = f"{sheet[1]} x {self.world}" if float8_share else \
                f"{column} datasheet peak x {self.world} ({sheet[1]})"
        else:
            self.peak = self.measured_peak
            self.peak_source = f"the matmul rate measured here (no {'float8 ' if float8_share else ''}datasheet row " \
                               f"for {name or device.type + ' devices'})"
        self.tokens_per_step, self.flops_per_token, self.total_steps = tokens_per_step, flops_per_token, steps
        self.tokens_per_s = self.mfu = self.mfu_measured = self.memory_gib = 0.0
        self.reserved_gib = None
        super().__init__(device)

    def report(self, rank: int, step: int, loss: float, lr: float, norm: float) -> None:
        """Rank 0 prints the line for `step`; collective (the peak memory is the world's largest)."""
        elapsed = self.training_seconds()
        self.tokens_per_s = self.steps * self.tokens_per_step / elapsed
        self.mfu = self.tokens_per_s * self.flops_per_token / self.peak
        self.mfu_measured = self.tokens_per_s * self.flops_per_token / self.measured_peak
        peak, reserved = peak_memory(self.device)
        memory = torch.tensor([peak, reserved or 0], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(memory, op=dist.ReduceOp.MAX)
        self.memory_gib = memory[0].item() / 2 ** 30
        self.reserved_gib = memory[1].item() / 2 ** 30 if reserved is not None else None
        held = f"peak memory {self.memory_gib:.2f} GiB allocated, {self.reserved_gib:.2f} GiB reserved" \
            if self.reserved_gib is not None else \
            f"peak RSS {self.memory_gib:.2f} GiB{'' if self.windowed else ' (since the start)'}"
        aside = ", ".join(f"{k} {v:.1f} s" for k, v in self.aside.items() if v)
        left = (self.total_steps - step) * elapsed / self.steps
        log(rank, f"step {step:>6}/{self.total_steps}  loss {loss:.4f}  lr {lr:.2e}  grad_norm {norm:.3f}  tokens/s "
                  f"{self.tokens_per_s:,.0f}  MFU {100 * self.mfu:.1f}% ({100 * self.mfu_measured:.1f}% of "
                  f"measured)  {held}  {f'(not counted: {aside})  ' if aside else ''}time left {left:.0f} s")
        self.restart()

    def figures(self) -> dict:
        return {"tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "mfu_of_measured": self.mfu_measured,
                "peak_tflops": self.peak / 1e12, "peak_source": self.peak_source,
                "matmul_peak_tflops": self.measured_peak / 1e12, "peak_memory_gib": self.memory_gib,
                "peak_reserved_gib": self.reserved_gib, "eval_s": self.totals["eval"],
                "checkpoint_s": self.totals["checkpoint"]}


class Observers:
    """What --tensorboard, --profile-steps and --memory-snapshot write; none costs anything unless asked for. The
    TensorBoard scalars are rank 0's log line (the package is optional: without it the run says so in one line and
    goes on); the profiler's trace and the allocator's history (CUDA only: torch's private recorder, the one
    pytorch.org/memory_viz reads) are each rank's. `window`: the steps to profile (first, last) or None."""

    def __init__(self, device: torch.device, rank: int, tensorboard: str | None = None, window=None,
                 profile_dir: str = "profile", memory_snapshot: str | None = None):
        self.device, self.rank, self.window, self.profile_dir = device, rank, window, profile_dir
        self.writer = self.profiler = self.range = None
        if tensorboard and rank == 0:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.writer = SummaryWriter(tensorboard)
            except ImportError:
                log(rank, "--tensorboard: the tensorboard package is not installed (pip install tensorboard); "
                          "training goes on without it")
        self.snapshot, self.steps = memory_snapshot if device.type == "cuda" else None, 0
        if memory_snapshot and device.type != "cuda":
            log(rank, f"--memory-snapshot: it records the CUDA allocator, which {device.type} ranks do not use")
        if self.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=100_000)   # from before the model is built

    def scalars(self, step: int, **values) -> None:
        for name, value in values.items():
            if self.writer and value is not None:
                self.writer.add_scalar(name, value, step)

    def before_step(self, step: int) -> None:
        if self.window and self.profiler is None and self.window[0] <= step <= self.window[1]:
            cuda = [torch.profiler.ProfilerActivity.CUDA] if self.device.type == "cuda" else []
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, *cuda])
            self.profiler.start()
        if self.profiler is not None:                   # each step a named range in the trace
            self.range = torch.profiler.record_function(f"train step {step}")
            self.range.__enter__()

    def after_step(self, step: int, last: bool = False) -> None:     # last: the run ends, write what records
        self.steps += 1
        if self.profiler is not None and self.range is not None:
            self.range.__exit__(None, None, None)
            self.range = None
        if self.profiler is not None and (step >= self.window[1] or last):
            self.profiler.stop()
            path = Path(self.profile_dir) / f"trace_rank{self.rank}_steps{self.window[0]}-{step}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            self.profiler.export_chrome_trace(str(path))
            self.profiler = self.window = None
            log(self.rank, f"step {step:>6}  profiler trace: {path} (and the other ranks'; ui.perfetto.dev opens it)")
        if self.snapshot and (self.steps >= SNAPSHOT_STEPS or last):
            torch.cuda.memory._dump_snapshot(f"{self.snapshot}_rank{self.rank}.pickle")
            torch.cuda.memory._record_memory_history(enabled=None)
            log(self.rank, f"step {step:>6}  memory snapshot: {self.snapshot}_rank*.pickle (pytorch.org/memory_viz)")
            self.snapshot = None

    def close(self, step: int) -> None:
        if self.profiler is not None or self.snapshot:
            self.after_step(step, last=True)
        if self.writer:
            self.writer.close()
