"""What helpers.measure.pipeline makes of a bubble sweep's records: the executed orders, the measured idle time, the
schedule's own IR beside them, the tables. (Counting the bubble is notebook 08's lesson: tests/recipe/
test_pipeline_replay.py holds the recipe's `replay` against the closed form.)"""
from __future__ import annotations

import torch

from helpers.measure.activations import LiveSavedBytes
from helpers.measure.pipeline import (bubble_table, ir_report, measured_idle_fraction, orders_from_ir, orders_from_log,
                                      peaks_table, step_seconds, summarize_runs)


def test_orders_and_idle_time_from_a_recorded_log():
    logs = {0: [(0, "B", 0, 3.0, 4.0), (0, "F", 0, 0.0, 1.0)], 1: [(1, "F", 0, 1.0, 2.0), (1, "B", 0, 2.0, 3.0)]}
    assert orders_from_log(logs) == {0: [(0, "F", 0), (0, "B", 0)], 1: [(1, "F", 0), (1, "B", 0)]}
    assert measured_idle_fraction(logs) == 0.5  # 4 busy seconds out of 2 ranks x 4 s


def test_live_saved_bytes_peak_and_release():
    w = torch.nn.Parameter(torch.ones(256))
    meter = LiveSavedBytes()
    with meter:
        losses = []
        for _ in range(3):
            x = torch.ones(256, requires_grad=True)
            losses.append(((x * 2) * w).sum())   # saves x*2 (1 KiB); w is a parameter, not counted
        held = meter.current
        for loss in losses:
            loss.backward()
    assert held == 3 * 256 * 4 and meter.peak == held
    assert meter.current == 0, "backward released what it used"


def test_orders_from_the_schedules_ir_keep_forwards_and_backwards():
    ir = {0: ["0F0", None, "0F1", "0B0", "0B1", "0REDUCE_GRAD"], 1: [None, "1F0", "1B0", "1F1", "1B1"]}
    assert orders_from_ir(ir) == {0: [(0, "F", 0), (0, "F", 1), (0, "B", 0), (0, "B", 1)],
                                  1: [(1, "F", 0), (1, "B", 0), (1, "F", 1), (1, "B", 1)]}


def test_the_ir_of_a_zero_bubble_schedule_keeps_its_input_and_weight_halves():
    ir = {0: ["0F0", "0SEND_F0", "0I0", "0W0"], 1: [None, "1RECV_F0", "1F0", "1I0", "1W0", "1SEND_B0"]}
    assert orders_from_ir(ir) == {0: [(0, "F", 0), (0, "I", 0), (0, "W", 0)],
                                  1: [(1, "F", 0), (1, "I", 0), (1, "W", 0)]}


def test_summarized_runs_measure_and_keep_the_executed_order_and_the_ir():
    # 1F1B, p = 2, m = 2, every action one second: rank 1 waits 1 s at the start, rank 0 1 s between B0 and B1
    step = {0: [(0, "F", 0, 0, 1), (0, "F", 1, 1, 2), (0, "B", 0, 3, 4), (0, "B", 1, 5, 6)],
            1: [(1, "F", 0, 1, 2), (1, "B", 0, 2, 3), (1, "F", 1, 3, 4), (1, "B", 1, 4, 5)]}
    slower = {r: [(s, k, mb, 2 * t0, 2 * t1) for s, k, mb, t0, t1 in log] for r, log in step.items()}
    ir = {r: [f"{s}{k}{mb}" for s, k, mb, *_ in log] + ["None"] for r, log in step.items()}
    results = [{"rank": r, "runs": [{"schedule": "1f1b", "m": 2, "stages": [r], "logs": [step[r], slower[r], step[r]],
                                     "peak_saved": 100 * (r + 1), "ir": ir}]} for r in (0, 1)]
    (row,) = summarize_runs(results)
    executed = {r: [(s, k, mb) for s, k, mb, *_ in log] for r, log in step.items()}
    assert (row["p"], row["v"], row["m"]) == (2, 1, 2) and row["orders"] == executed == row["ir"]
    assert row["measured"] == measured_idle_fraction(step) == 1 - 8 / 12
    assert row["step_s"] == step_seconds(step) == 6  # the median of 6, 12, 6 seconds
    assert row["peak_saved"] == {0: 100, 1: 200}
    assert [label for *_, label in row["events"][0]] == ["F0", "F1", "B0", "B1"]
    seen = []
    report = ir_report(row, lambda order: seen.append(order) or 1 / 3)
    assert "matches the executed order; it replays to 0.3333" in report and seen == [row["ir"]]


def test_ir_report_shows_where_the_ir_differs_and_an_ir_that_cannot_run():
    orders = {0: [(0, "F", 0), (0, "B", 0)], 1: [(1, "F", 0), (1, "B", 0), (1, "F", 1), (1, "B", 1)]}
    row = {"schedule": "1f1b", "orders": orders, "ir": {0: orders[0], 1: [(1, "F", 1), (1, "B", 0)]}}

    def cannot_run(order):
        raise ValueError("no rank can proceed")

    report = ir_report(row, cannot_run)
    assert "differs on ranks [1]" in report and "cannot be replayed (no rank can proceed)" in report
    assert "rank 1 IR:       F1 B0" in report and "rank 1 executed: F0 B0 F1 B1" in report


def test_peaks_table_one_line_per_m_with_a_dash_where_a_schedule_did_not_run():
    rows = [{"schedule": "gpipe", "m": 1, "peak_saved": {0: 1000, 1: 2000}},
            {"schedule": "gpipe", "m": 2, "peak_saved": {0: 2000, 1: 4000}},
            {"schedule": "1f1b", "m": 2, "peak_saved": {0: 2000, 1: 2000}}]
    lines = peaks_table(rows, ("gpipe", "1f1b")).splitlines()
    assert lines[1].split() == ["m", "gpipe", "s=0", "1f1b", "s=0", "gpipe", "s=1", "1f1b", "s=1"]
    assert lines[2].split() == ["1", "1,000", "-", "2,000", "-"]
    assert lines[3].split() == ["2", "2,000", "2,000", "4,000", "2,000"]


def test_bubble_table_one_line_per_run_counted_formula_measured():
    rows = [{"schedule": "gpipe", "m": 1, "p": 2, "counted": 0.5, "formula": 0.5, "measured": 0.61234},
            {"schedule": "interleaved", "m": 16, "p": 2, "counted": 1 / 33, "formula": 1 / 33, "measured": 0.1}]
    lines = bubble_table(rows).splitlines()
    assert lines[0].startswith("p = 2 ranks;") and len(lines) == 3
    assert lines[1].split() == ["gpipe", "m", "=", "1:", "0.5000", "|", "0.5000", "|", "0.612"]
    assert lines[2].split() == ["interleaved", "m", "=", "16:", "0.0303", "|", "0.0303", "|", "0.100"]
