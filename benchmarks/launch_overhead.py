"""Benchmark: the wall time of a trivial 2-rank gloo launch, helpers.launch against the alternatives.

Every launcher is timed in this one process after it has run a multi-threaded backward pass (a kernel that has
trained something). Prints the first launch and the median of the later ones; asserts nothing about time (a loaded
machine is not a failure). Targets: at most 0.6x accelerate's notebook_launcher (median), and on a GPU machine at
most 0.1 s per launch after the first. Run: ./cookbook bench
"""
from __future__ import annotations

import argparse
import sys
import time

from helpers import machine_facts
from helpers.measure.launch_overhead import OURS, compare_launchers, compare_persistent_calls, comparison_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    facts = machine_facts()
    date = time.strftime("%Y-%m-%d", time.gmtime())
    device = (", ".join(facts["gpu_names"]) or f"{facts['gpus']} GPU(s)") if facts["gpus"] else "no GPU"
    print(f"{date}; torch {facts['torch']}, Python {facts['python']}, {facts['cores']} cores, CPU "
          f"{facts['cpu_capability']}, {device}; world size {args.world_size}, first launch then {args.repeats} more "
          "each, in a process that has run a multi-threaded backward pass")
    results = compare_launchers(args.world_size, args.repeats)
    print(comparison_table(results))
    ours = results[OURS]["median_s"]
    rival = results.get("accelerate notebook_launcher")
    if rival is None:
        print("target (at most 0.6x accelerate's notebook_launcher): not checked, accelerate is not installed")
    else:
        ratio = ours / rival["median_s"]
        print(f"target (at most 0.6x accelerate's notebook_launcher): {'met' if ratio <= 0.6 else 'NOT met'} "
              f"({ours:.3f} s against {rival['median_s']:.3f} s: {ratio:.2f}x)")
    calls = compare_persistent_calls(args.world_size, repeats=max(15, args.repeats))
    print("\nper call of a trivial function (first s: the ranks' start for Workers)")
    persistent = calls["helpers.Workers.run (ranks kept)"]["median_s"]
    print(comparison_table(calls, reference="helpers.Workers.run (ranks kept)"))
    print(f"target (at most a tenth of nbdistributed 0.1.0's 0.139 s per trivial cell, measured on the 2-core "
          f"machine): {'met' if persistent <= 0.0139 else 'NOT met'} ({persistent * 1e3:.1f} ms)")
    if facts["gpus"]:
        print(f"target (GPU machine, at most 0.1 s per launch after the first): "
              f"{'met' if ours <= 0.1 else 'NOT met'} ({ours:.3f} s)")
    print("\nfor docs/measurements.md:\n" + measurements_row(date, device, facts["torch"], results, persistent))


def measurements_row(date: str, device: str, torch_version: str, results: dict, persistent: float) -> str:
    """The run as one row of docs/measurements.md's table: each launcher's first launch and median (min-max)."""
    figures = "; ".join(f"{name}: first {r['first_s']:.3f} s, median {r['median_s']:.3f} s "
                        f"({r['min_s']:.3f}-{r['max_s']:.3f}, {len(r['samples'])} launches)"
                        for name, r in results.items())
    command = "python " + " ".join(["benchmarks/launch_overhead.py", *sys.argv[1:]])
    return (f"| {date} | {device} | {torch_version} | `{command}` | after a backward pass: {figures}; "
            f"Workers.run {persistent * 1e3:.1f} ms per call |")


if __name__ == "__main__":
    main()
