"""Benchmark: the wall time of a trivial 2-rank gloo launch, helpers.launch against the alternatives.

Every launcher is timed in this one process after it has run a multi-threaded backward pass (a kernel that has
trained something). Prints the first launch and the median of the later ones; asserts nothing about time (a loaded
machine is not a failure). Targets: at most 0.6x accelerate's notebook_launcher (median), and on a GPU machine at
most 0.1 s per launch after the first. Run: ./cookbook bench (on the GPU machine, which has no network for
./cookbook's set-up: bash .gpu/on-device.sh python3 benchmarks/launch_overhead.py). Its last line is a row for
docs/measurements.md.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from helpers import machine_facts
from helpers.measure.launch_overhead import (OURS, compare_launchers, compare_persistent_calls, comparison_table,
                                            measurements_row)


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
    command = " ".join([os.path.basename(sys.executable), "benchmarks/launch_overhead.py", *sys.argv[1:]])
    print("\nfor docs/measurements.md:\n" + measurements_row(date, device, facts["torch"], command, results, persistent))


if __name__ == "__main__":
    main()
