"""Benchmark: the median wall time of a trivial 2-rank gloo launch, helpers.launch against the alternatives.

Prints figures; asserts nothing about time (a loaded machine is not a failure). Run: ./cookbook bench
"""
from __future__ import annotations

import argparse

from helpers import machine_facts
from helpers.measure.launch_overhead import comparison_table, compare_launchers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    facts = machine_facts()
    print(f"torch {facts['torch']}, {facts['cores']} cores, CPU {facts['cpu_capability']}, "
          f"world size {args.world_size}, {args.repeats} launches each after one warm-up")
    results = compare_launchers(args.world_size, args.repeats)
    print(comparison_table(results))
    ours = results["helpers.launch (fork)"]["median_s"]
    rival = results.get("accelerate notebook_launcher")
    if rival is None:
        print("target (faster than accelerate's notebook_launcher): not checked, accelerate is not installed")
    else:
        verdict = "met" if ours < rival["median_s"] else "NOT met"
        print(f"target (faster than accelerate's notebook_launcher): {verdict} "
              f"({ours:.3f} s against {rival['median_s']:.3f} s)")


if __name__ == "__main__":
    main()
