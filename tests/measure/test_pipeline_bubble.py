"""The pipeline bubble counted by replaying orders of actions, checked on orders written out by hand."""
from __future__ import annotations

import math
import sys

import pytest
import torch

from helpers.measure.activations import LiveSavedBytes
from helpers.measure.pipeline import (bubble_formula, bubble_table, ir_report, measured_idle_fraction,
                                      orders_from_ir, orders_from_log, peaks_table, replay, step_seconds,
                                      summarize_runs)
from helpers.paths import SCRIPTS

if str(SCRIPTS / "train") not in sys.path:  # the recipe's modules (notebook 08 writes pipeline.py), as notebooks do
    sys.path.insert(0, str(SCRIPTS / "train"))
from pipeline import record_actions  # noqa: E402


def gpipe(p: int, m: int) -> dict:
    return {s: [(s, "F", i) for i in range(m)] + [(s, "B", i) for i in range(m)] for s in range(p)}


def one_f_one_b(p: int, m: int) -> dict:
    orders = {}
    for s in range(p):
        warmup = min(p - 1 - s, m)
        acts = [(s, "F", i) for i in range(warmup)]
        f, b = warmup, 0
        while f < m:
            acts += [(s, "F", f), (s, "B", b)]
            f, b = f + 1, b + 1
        acts += [(s, "B", i) for i in range(b, m)]
        orders[s] = acts
    return orders


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("make", [gpipe, one_f_one_b], ids=["gpipe", "1f1b"])
def test_replayed_bubble_is_the_closed_form(make, p, m):
    result = replay(make(p, m))
    assert math.isclose(result["idle_fraction"], bubble_formula(p, m), abs_tol=1e-12)
    assert result["makespan"] == 2 * (m + p - 1)


def test_backward_twice_as_long_keeps_the_fraction():
    assert math.isclose(replay(gpipe(4, 6), backward_cost=2.0)["idle_fraction"], bubble_formula(4, 6))


def test_an_order_that_cannot_run_is_refused():
    orders = {0: [(0, "B", 0), (0, "F", 0)], 1: [(1, "F", 0), (1, "B", 0)]}
    with pytest.raises(ValueError, match="no rank can proceed"):
        replay(orders)


def test_interleaved_formula_reduces_to_the_plain_one():
    assert bubble_formula(4, 8, 1) == 3 / 11
    assert bubble_formula(8, 8, 2) == 3 / 19  # 4 ranks with 2 stages each


def test_orders_and_idle_time_from_a_recorded_log():
    logs = {0: [(0, "B", 0, 3.0, 4.0), (0, "F", 0, 0.0, 1.0)], 1: [(1, "F", 0, 1.0, 2.0), (1, "B", 0, 2.0, 3.0)]}
    assert orders_from_log(logs) == {0: [(0, "F", 0), (0, "B", 0)], 1: [(1, "F", 0), (1, "B", 0)]}
    assert measured_idle_fraction(logs) == 0.5  # 4 busy seconds out of 2 ranks x 4 s


def _acts(text: str) -> list:
    """'0F0 0I0 0W0' -> [(0, 'F', 0), (0, 'I', 0), (0, 'W', 0)]."""
    return [(int(a[0]), a[1], int(a[2:])) for a in text.split()]


def test_a_backward_split_in_input_and_weight_halves_is_replayed_with_their_dependencies():
    """p = 2, m = 2, F = I = W = 1 slot (backward_cost 2). Stage 0 waits for stage 1's I, not its W: with each W
    right after its I, stage 1's I1 ends at 6 and the step at 8 (a full B would end at 9, 1F1B's (p-1)/(m+p-1));
    stage 1 deferring W0 past F1 and I1 gives stage 0 its gradient at 5, and the step ends at 7."""
    first = _acts("0F0 0F1 0I0 0W0 0I1 0W1")
    in_place = {0: first, 1: _acts("1F0 1I0 1W0 1F1 1I1 1W1")}
    deferred = {0: first, 1: _acts("1F0 1I0 1F1 1I1 1W0 1W1")}
    full = {0: _acts("0F0 0F1 0B0 0B1"), 1: _acts("1F0 1B0 1F1 1B1")}
    assert replay(full, backward_cost=2)["makespan"] == 9
    assert replay(full, backward_cost=2)["idle_fraction"] == bubble_formula(2, 2)
    assert replay(in_place, backward_cost=2)["makespan"] == 8
    assert replay(deferred, backward_cost=2)["makespan"] == 7
    assert replay(deferred, backward_cost=2)["idle_fraction"] == 2 / 14


def test_a_weight_half_before_its_input_half_cannot_run():
    with pytest.raises(ValueError, match="no rank can proceed"):
        replay({0: _acts("0F0 0W0 0I0")})


def test_record_actions_names_the_halves_of_a_split_backward():
    class Stage:                       # the three methods a PipelineStage's schedule calls
        stage_index = 3

        def forward_one_chunk(self, mb, *args, **kwargs):
            return mb

        def backward_one_chunk(self, mb, loss=None, full_backward=True, last_backward=False):
            return mb

        def backward_weight_one_chunk(self, mb, last_backward=False):
            return mb

    stage, log = Stage(), []
    record_actions(stage, log)
    stage.forward_one_chunk(0, ("x",), {})
    stage.backward_one_chunk(0, loss=None, full_backward=False, last_backward=False)
    stage.backward_weight_one_chunk(0, last_backward=True)
    stage.backward_one_chunk(1, loss=None, full_backward=True, last_backward=False)
    stage.backward_one_chunk(2)
    assert [(s, k, mb) for s, k, mb, *_ in log] == [(3, "F", 0), (3, "I", 0), (3, "W", 0), (3, "B", 1), (3, "B", 2)]


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
    assert replay(orders_from_ir(ir))["idle_fraction"] == bubble_formula(2, 2)


def test_the_ir_of_a_zero_bubble_schedule_keeps_its_input_and_weight_halves():
    ir = {0: ["0F0", "0SEND_F0", "0I0", "0W0"], 1: [None, "1RECV_F0", "1F0", "1I0", "1W0", "1SEND_B0"]}
    assert orders_from_ir(ir) == {0: _acts("0F0 0I0 0W0"), 1: _acts("1F0 1I0 1W0")}


def test_summarized_runs_count_measure_and_keep_the_ir():
    # 1F1B, p = 2, m = 2, every action one second: rank 1 waits 1 s at the start, rank 0 1 s between B0 and B1
    step = {0: [(0, "F", 0, 0, 1), (0, "F", 1, 1, 2), (0, "B", 0, 3, 4), (0, "B", 1, 5, 6)],
            1: [(1, "F", 0, 1, 2), (1, "B", 0, 2, 3), (1, "F", 1, 3, 4), (1, "B", 1, 4, 5)]}
    slower = {r: [(s, k, mb, 2 * t0, 2 * t1) for s, k, mb, t0, t1 in log] for r, log in step.items()}
    ir = {r: [f"{s}{k}{mb}" for s, k, mb, *_ in log] + ["None"] for r, log in step.items()}
    results = [{"rank": r, "runs": [{"schedule": "1f1b", "m": 2, "stages": [r], "logs": [step[r], slower[r], step[r]],
                                     "peak_saved": 100 * (r + 1), "ir": ir}]} for r in (0, 1)]
    (row,) = summarize_runs(results)
    assert (row["p"], row["v"], row["m"]) == (2, 1, 2) and row["orders"] == one_f_one_b(2, 2) == row["ir"]
    assert row["counted"] == row["formula"] == 1 / 3
    assert row["measured"] == measured_idle_fraction(step) == 1 - 8 / 12  # equal costs: measured idle = counted
    assert row["step_s"] == step_seconds(step) == 6  # the median of 6, 12, 6 seconds
    assert row["peak_saved"] == {0: 100, 1: 200}
    assert [label for *_, label in row["events"][0]] == ["F0", "F1", "B0", "B1"]
    assert "matches the executed order; it replays to 0.3333" in ir_report(row)
    (doubled,) = summarize_runs(results, backward_cost=2.0)   # a backward twice a forward: 1F1B's fraction holds
    assert doubled["counted"] == 1 / 3 and "it replays to 0.3333" in ir_report(doubled)


def test_ir_report_shows_where_the_ir_differs():
    orders = one_f_one_b(2, 2)
    row = {"schedule": "1f1b", "orders": orders, "ir": {0: orders[0], 1: [(1, "F", 1), (1, "B", 0)]}}
    report = ir_report(row)
    assert "differs on ranks [1]" in report and "cannot be replayed" in report
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
