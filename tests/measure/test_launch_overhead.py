"""helpers.measure.launch_overhead's summaries of a launcher comparison: the figures docs/measurements.md asks for
(first launch, then the median and spread of the later ones), read from timings given here, not measured."""
from __future__ import annotations

import pytest

from helpers.measure.launch_overhead import OURS, comparison_table, measurements_row, time_launches

RESULTS = {OURS: {"first_s": 3.5, "median_s": 0.07, "min_s": 0.06, "max_s": 0.09, "samples": [0.06, 0.07, 0.09],
                  "changed_handlers": []},
           "helpers.launch (spawn)": {"first_s": 3.6, "median_s": 3.5, "min_s": 3.4, "max_s": 3.7,
                                      "samples": [3.4, 3.5, 3.7], "changed_handlers": []}}


def test_the_row_for_measurements_md_has_every_launchers_first_median_and_spread():
    row = measurements_row("2026-11-23", "NVIDIA H100", "2.11.0+cu130", "python benchmarks/launch_overhead.py",
                           RESULTS, 0.002)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:4] == ["2026-11-23", "NVIDIA H100", "2.11.0+cu130", "`python benchmarks/launch_overhead.py`"]
    assert f"{OURS}: first 3.500 s, median 0.070 s (min 0.060, max 0.090, 3 launches)" in cells[4]
    assert "helpers.launch (spawn): first 3.600 s, median 3.500 s (min 3.400, max 3.700, 3 launches)" in cells[4]
    assert "Workers.run 2.0 ms per call" in cells[4]


def test_the_table_gives_each_launcher_against_ours():
    lines = comparison_table(RESULTS).splitlines()
    assert len(lines) == 3 and lines[2].split()[-2:] == ["50.0", "none"]


def test_time_launches_keeps_the_first_apart_from_the_repeats():
    calls = []
    timed = time_launches(lambda: calls.append(1), repeats=4)
    assert len(calls) == 5 and len(timed["samples"]) == 4
    assert timed["min_s"] <= timed["median_s"] <= timed["max_s"]
    with pytest.raises(ValueError):
        time_launches(lambda: None, repeats=0)
