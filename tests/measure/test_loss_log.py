"""helpers.measure.loss_log reads the recipe's per-step loss log (train.py --metrics) back as attempts."""
from __future__ import annotations

import json

from helpers.measure import loss_log


def test_a_new_attempt_starts_where_the_steps_go_back_and_evaluations_are_left_out(tmp_path):
    steps = [1, 2, 3, 4, 5, 3, 4, 5, 6]  # killed after step 5, resumed from the checkpoint of step 2
    lines = [{"step": s, "loss": float(i), "lr": 0.1, "grad_norm": 1.0} for i, s in enumerate(steps)]
    lines.insert(4, {"step": 4, "eval_loss": 9.0})  # an evaluation after step 4
    lines.append({"step": 6, "eval_loss": 8.0, "final": True})
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in lines))
    first, second = loss_log.attempts(log)
    assert first == {1: 0.0, 2: 1.0, 3: 2.0, 4: 3.0, 5: 4.0} and second == {3: 5.0, 4: 6.0, 5: 7.0, 6: 8.0}
    assert len(loss_log.records(log)) == len(steps) + 2
