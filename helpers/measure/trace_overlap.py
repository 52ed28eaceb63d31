"""How much of a step's communication ran while computation ran, read from a profiler trace (Chrome/Perfetto JSON).

Why from the trace: DDP's promise is that gradient all-reduces run while backward still computes. The trace a
reader already exports (`prof.export_chrome_trace`) holds both as timed spans; the share of communication time
covered by computation is the overlap, and the part not covered is what communication adds to a step.
Intervals are merged first (union), so nested or parallel spans of one kind are not counted twice.
"""
from __future__ import annotations

import json
from pathlib import Path

COMM_MARKERS = ("gloo:", "nccl:", "ncclkernel", "ncclDevKernel", "c10d::", "allreduce", "all_reduce",
                "broadcast", "reduce_scatter", "all_gather")
COMPUTE_MARKERS = ("aten::mm", "aten::addmm", "aten::matmul", "aten::linear", "aten::tanh", "aten::relu",
                   "autograd::engine::evaluate_function", "Backward", "aten::conv")


def is_comm(event: dict) -> bool:
    name = event.get("name", "")
    return any(m.lower() in name.lower() for m in COMM_MARKERS)


def is_compute(event: dict) -> bool:
    name = event.get("name", "")
    return not is_comm(event) and any(m.lower() in name.lower() for m in COMPUTE_MARKERS)


def load_events(trace) -> list[dict]:
    """The complete ('X') events of a trace file, a JSON string's dict, or a list of events."""
    if isinstance(trace, (str, Path)) and Path(trace).exists():
        trace = json.loads(Path(trace).read_text())
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merged, sorted, disjoint intervals covering the same time."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def covered(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two unions of intervals."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap(trace, comm=is_comm, compute=is_compute) -> dict:
    """Communication time, computation time, the part of communication covered by computation, and its share (µs)."""
    events = load_events(trace)
    comm_iv = union([(e["ts"], e["ts"] + e["dur"]) for e in events if comm(e)])
    compute_iv = union([(e["ts"], e["ts"] + e["dur"]) for e in events if compute(e)])
    comm_us = sum(b - a for a, b in comm_iv)
    both = covered(comm_iv, compute_iv)
    return {"comm_us": comm_us, "compute_us": sum(b - a for a, b in compute_iv), "overlap_us": both,
            "exposed_comm_us": comm_us - both, "overlap_share": both / comm_us if comm_us else float("nan"),
            "comm_intervals": comm_iv, "compute_intervals": compute_iv}


def is_gpu_comm(event: dict) -> bool:
    """A GPU trace's communication: NCCL's kernels on the device (host spans only say when work was queued)."""
    return event.get("cat") == "kernel" and "nccl" in event.get("name", "").lower()


def is_gpu_compute(event: dict) -> bool:
    """A GPU trace's computation: every other kernel on the device."""
    return event.get("cat") == "kernel" and "nccl" not in event.get("name", "").lower()


def overlap_of_trace(trace, device_type: str) -> dict:
    """`overlap` of a step traced on `device_type`: on CPU ranks the profiler's host events (gloo's all-reduces on
    its own threads, backward's ops on autograd's), on GPU ranks the device's kernels (NCCL's against the others)."""
    if device_type == "cuda":
        return overlap(trace, comm=is_gpu_comm, compute=is_gpu_compute)
    return overlap(trace)
