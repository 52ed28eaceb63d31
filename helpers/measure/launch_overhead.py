"""What starting N workers costs, measured the same way for every launcher (notebook 00 and the benchmark).

Why a trivial job: init_process_group, one all_reduce, destroy, return. Everything measured is start-up and
teardown, which is what a notebook user pays on every cell that launches workers. Why autograd first: a kernel
that has trained anything holds autograd's and OpenMP's threads, the state in which forking the kernel (what
accelerate's notebook_launcher does) is unsafe; every launcher is timed in that state. The first launch is
reported apart from the median of the later ones: it includes the fork-server's start (helpers.launch) or
nothing special (the others start from scratch every time).
"""
from __future__ import annotations

import os
import signal
import statistics
import time
from typing import Callable


def trivial_all_reduce() -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


def _spawn_entry(rank: int, world_size: int, port: int) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    trivial_all_reduce()


def with_helpers_launch(world_size: int = 2, start_method: str = "forkserver") -> None:
    from helpers.launcher.api import launch

    result = launch(trivial_all_reduce, world_size=world_size, quiet=True, timeout=120, start_method=start_method)
    assert result == [float(world_size)] * world_size


def with_helpers_spawn(world_size: int = 2) -> None:
    with_helpers_launch(world_size, "spawn")


def run_autograd(threads: int = 2) -> None:
    """A multi-threaded backward pass in this process: what a kernel that trained anything has done."""
    import torch

    torch.set_num_threads(threads)
    weight = torch.randn(512, 512, requires_grad=True)
    (weight @ weight).tanh().sum().backward()


def with_mp_spawn(world_size: int = 2) -> None:
    """torch.multiprocessing.spawn: a fresh interpreter per rank, importing torch each time."""
    import torch.multiprocessing as tmp

    from helpers.launcher.api import free_port

    tmp.start_processes(_spawn_entry, args=(world_size, free_port()), nprocs=world_size, start_method="spawn")


def with_notebook_launcher(world_size: int = 2) -> None:
    """accelerate's notebook_launcher (fork through torch elastic's start_processes)."""
    import contextlib
    import io

    from accelerate import notebook_launcher

    from helpers.launcher.api import free_port

    # Its banner says "Launching training on N CUDAs." even on a CPU-only machine: keep it out of the output.
    with contextlib.redirect_stdout(io.StringIO()):
        notebook_launcher(trivial_all_reduce, num_processes=world_size, use_port=str(free_port()))


def available_launchers() -> dict[str, Callable[[int], None]]:
    """The launchers this machine can compare: accelerate's only where it is installed."""
    found = {OURS: with_helpers_launch, "helpers.launch (spawn)": with_helpers_spawn,
             "torch.multiprocessing spawn": with_mp_spawn}
    try:
        import accelerate  # noqa: F401

        found["accelerate notebook_launcher"] = with_notebook_launcher
    except ImportError:
        pass
    return found


OURS = "helpers.launch (forkserver)"


def time_launches(start: Callable[[], None], repeats: int = 7) -> dict:
    """The first call's wall time, then the median and spread of `repeats` more calls of `start()`."""
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    t0 = time.perf_counter()
    start()
    first = time.perf_counter() - t0
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        start()
        samples.append(time.perf_counter() - t0)
    return {"first_s": first, "median_s": statistics.median(samples), "min_s": min(samples),
            "max_s": max(samples), "samples": samples}


_WATCHED = [s for s in ("SIGINT", "SIGTERM", "SIGCHLD", "SIGUSR1") if hasattr(signal, s)]


def _handlers() -> dict:
    return {name: signal.getsignal(getattr(signal, name)) for name in _WATCHED}


def compare_launchers(world_size: int = 2, repeats: int = 7) -> dict[str, dict]:
    """Every available launcher timed in this process, one after the other, on the same trivial job.

    Each result also says which of this process's signal handlers the launcher replaced ("changed_handlers"),
    and they are put back: torch elastic, under accelerate's notebook_launcher, installs its own SIGINT and SIGTERM
    handlers in the kernel and leaves them there, so interrupting a later cell no longer raises KeyboardInterrupt.
    """
    from helpers.launcher.server import stop_server

    run_autograd()
    stop_server()  # so that helpers.launch's first launch includes starting its server, as in a fresh kernel
    results = {}
    for name, fn in available_launchers().items():
        before = _handlers()
        try:
            results[name] = time_launches(lambda fn=fn: fn(world_size), repeats=repeats)
        finally:
            after = _handlers()
            for sig_name, handler in before.items():
                if after[sig_name] is not handler:
                    signal.signal(getattr(signal, sig_name), handler)
        results[name]["changed_handlers"] = sorted(k for k in before if after[k] is not before[k])
    return results


def comparison_table(results: dict[str, dict], reference: str = OURS) -> str:
    """The comparison as text: first launch, median and spread of the later ones, ratio to `reference`, and the
    signal handlers each launcher replaced in this process."""
    ours = results[reference]["median_s"]
    lines = [f"{'launcher':<40} {'first s':>8} {'median s':>9} {'min s':>7} {'max s':>7} {'x ours':>7}  "
             "kernel signal handlers replaced"]
    for name, r in results.items():
        changed = ", ".join(r.get("changed_handlers", [])) or "none"
        lines.append(f"{name:<40} {r['first_s']:>8.3f} {r['median_s']:>9.3f} {r['min_s']:>7.3f} {r['max_s']:>7.3f} "
                     f"{r['median_s'] / ours:>7.1f}  {changed}")
    return "\n".join(lines)


def compare_persistent_calls(world_size: int = 2, repeats: int = 15) -> dict[str, dict]:
    """Per-call cost of a trivial function on `Workers` (ranks kept alive) against a fresh `launch` each time,
    side by side in this process. The persistent ranks' start is reported as their first call."""
    from helpers.launcher.api import launch
    from helpers.launcher.workers import Workers

    def trivial():
        return 1

    results = {"helpers.launch (fresh ranks each call)":
               time_launches(lambda: launch(trivial, world_size=world_size, quiet=True, timeout=120), repeats)}
    start = time.perf_counter()
    with Workers(world_size, timeout=120) as workers:
        started = time.perf_counter() - start
        results["helpers.Workers.run (ranks kept)"] = time_launches(lambda: workers.run(trivial), repeats)
    results["helpers.Workers.run (ranks kept)"]["first_s"] = started
    return results


def measurements_row(date: str, device: str, torch_version: str, command: str, results: dict[str, dict],
                     persistent_s: float) -> str:
    """A benchmark run as one row of docs/measurements.md's table (date, device, torch, command, figures): each
    launcher's first launch and the median, min and max of the later ones, and `Workers.run`'s median per call."""
    figures = "; ".join(f"{name}: first {r['first_s']:.3f} s, median {r['median_s']:.3f} s "
                        f"(min {r['min_s']:.3f}, max {r['max_s']:.3f}, {len(r['samples'])} launches)"
                        for name, r in results.items())
    return (f"| {date} | {device} | {torch_version} | `{command}` | after a backward pass: {figures}; "
            f"helpers.Workers.run {persistent_s * 1e3:.1f} ms per call |")
