"""helpers.measure.parameter_server: the closed forms of PS and ring bytes, and rates read from a server's record."""
from __future__ import annotations

import pytest

from helpers.measure.parameter_server import (interval_rates, judge_speedup, print_crash, ring_against_server,
                                               server_and_ring_bytes)


@pytest.mark.parametrize("n", [2, 3, 8, 64])
def test_ring_and_server_bytes_meet_the_closed_forms(n):
    b = server_and_ring_bytes(n, 1000.0)
    assert b["server_total"] == b["server_link"] == 2 * n * 1000.0  # n gradients up, n parameter copies down
    assert b["ring_total"] == pytest.approx(2 * (n - 1) * 1000.0)  # each rank sends 2(n-1)/n gradients
    assert b["total_cut"] == pytest.approx(100 / n)
    assert b["busiest_cut"] >= b["total_cut"]


def test_the_busiest_links_gain_grows_with_the_number_of_workers():
    cuts = [server_and_ring_bytes(n, 1.0)["busiest_cut"] for n in (2, 4, 8, 16)]
    assert cuts == sorted(cuts) and len(set(cuts)) == 4


def _record(times, samples):
    return {"curve": [{"time": t, "samples": s} for t, s in zip(times, samples)]}


def test_interval_rates_and_a_side_by_side_ratio(capsys):
    slow, fast = _record([0, 1, 2, 4], [0, 10, 20, 30]), _record([0, 0.5, 1, 2], [0, 10, 20, 30])
    assert interval_rates(slow) == [10.0, 10.0, 5.0]
    assert judge_speedup("x", 1.41, fast, slow, here="test") == 2.0
    assert "not comparable here" in capsys.readouterr().out


def test_the_ring_claims_verdict_follows_the_worker_count(capsys):
    bytes_by_n = ring_against_server([2, 8], 1000.0, workers=3)
    assert sorted(bytes_by_n) == [2, 3, 8]  # the judged count is always among those printed
    assert "verdict for 3 workers, total bytes: below" in capsys.readouterr().out  # 1/3 = 33% < 50%
    ring_against_server([8], 1000.0, workers=2)
    assert "verdict for 2 workers, total bytes: within" in capsys.readouterr().out  # exactly 50%


def test_print_crash_names_each_event(capsys):
    server = {"events": [{"time": 1.5, "update": 7, "trainer": "trainer2", "what": "ping failed: EPIPE"}],
              "updates": 20, "samples": 600, "curve": [{"accuracy": 0.9}], "shutdown": "timed out"}
    print_crash(RuntimeError("rank 2 died\ntraceback"), server, elapsed_s=3.0)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "the launcher: rank 2 died" and "after update 7: trainer2: ping failed: EPIPE" in out[1]
    assert "20 updates, 600 samples" in out[2] and out[3].endswith("3.0 s, none of it hanging")
