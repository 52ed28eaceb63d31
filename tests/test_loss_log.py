"""helpers.measure.loss_log reads the per-step loss log of notebook 06's recipe back as attempts."""
from __future__ import annotations

import json

import pytest

from helpers.measure import loss_log


def _write(run_dir, records, rank=0):
    with open(run_dir / f"losses.rank{rank}.jsonl", "w") as log:
        log.writelines(json.dumps(r) + "\n" for r in records)


def test_a_new_attempt_starts_where_the_steps_go_back(tmp_path):
    steps = [1, 2, 3, 4, 5, 3, 4, 5, 6]  # killed after step 5, resumed from the checkpoint of step 2
    _write(tmp_path, [{"step": s, "loss": float(i), "attempt": 0, "time": float(i)} for i, s in enumerate(steps)])
    first, second = loss_log.attempts(tmp_path)
    assert first == {1: 0.0, 2: 1.0, 3: 2.0, 4: 3.0, 5: 4.0} and second == {3: 5.0, 4: 6.0, 5: 7.0, 6: 8.0}
    assert len(loss_log.records(tmp_path)) == len(steps)


def test_restart_seconds_from_the_last_step_of_attempt_0_to_the_first_of_attempt_1(tmp_path):
    recs = [{"step": 1, "loss": 1.0, "attempt": 0, "time": 10.0}, {"step": 2, "loss": 1.0, "attempt": 0, "time": 11.5},
            {"step": 1, "loss": 1.0, "attempt": 1, "time": 14.0}, {"step": 2, "loss": 1.0, "attempt": 1, "time": 15.0}]
    _write(tmp_path, recs, rank=1)
    assert loss_log.restart_seconds(tmp_path, rank=1) == pytest.approx(2.5)
