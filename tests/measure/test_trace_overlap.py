"""trace_overlap on synthetic Chrome traces whose overlap is known by construction."""
import json
import math

from helpers.measure.trace_overlap import covered, overlap, union


def _x(name, ts, dur, tid=1):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def test_union_merges_nested_and_touching_intervals():
    assert union([(5, 7), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 7)]


def test_covered_is_the_length_of_the_intersection():
    assert covered([(0, 10)], [(2, 3), (5, 12)]) == 1 + 5
    assert covered([(0, 1)], [(2, 3)]) == 0


def test_overlap_of_a_synthetic_ddp_step(tmp_path):
    events = [_x("aten::addmm", 0, 100), _x("autograd::engine::evaluate_function: AddmmBackward0", 100, 100),
              _x("aten::addmm", 120, 30),  # nested in backward: counted once
              _x("gloo:all_reduce", 150, 100, tid=2),  # 50 under backward, 50 exposed
              {"ph": "i", "name": "gloo:all_reduce", "ts": 0}]  # an instant event: ignored
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    got = overlap(path)
    assert (got["comm_us"], got["compute_us"], got["overlap_us"], got["exposed_comm_us"]) == (100, 200, 50, 50)
    assert got["overlap_share"] == 0.5


def test_no_communication_gives_nan_share():
    assert math.isnan(overlap([_x("aten::mm", 0, 10)])["overlap_share"])
