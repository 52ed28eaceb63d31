"""helpers.measure.timing and devices.synchronize: the one step timer and the one summary of timings."""
from __future__ import annotations

import pytest
import torch

import helpers
from helpers.devices import synchronize
from helpers.measure.timing import summarize, time_steps, timed


def test_summarize():
    s = summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert s["median_s"] == 3.0 and s["min_s"] == 1.0 and s["max_s"] == 5.0
    assert s["q1_s"] == 2.0 and s["q3_s"] == 4.0 and s["half_iqr_s"] == 1.0
    one = summarize([7.0])
    assert one["median_s"] == one["q1_s"] == one["q3_s"] == 7.0 and one["half_iqr_s"] == 0.0
    robust = summarize([1, 2, 3, 4, 5, 6, 7, 100])
    assert robust["median_s"] == 4.5 and robust["half_iqr_s"] < 5  # one outlier barely moves either
    with pytest.raises(ValueError):
        summarize([])


def test_time_steps_calls_warmup_plus_repeats():
    calls = []
    times = time_steps(lambda: calls.append(1), repeats=5, warmup=3)
    assert len(calls) == 8 and len(times) == 5 and all(t >= 0 for t in times)


def test_timed_returns_the_result_and_a_duration():
    result, seconds = timed(lambda: sum(range(100000)), device=torch.device("cpu"))
    assert result == sum(range(100000)) and seconds > 0


def test_synchronize_is_a_no_op_on_the_cpu():
    synchronize(None)
    synchronize("cpu")
    synchronize(torch.device("cpu"))


def _timed_on_ranks():
    import torch.distributed as dist

    dist.init_process_group(helpers.default_backend())
    times = time_steps(lambda: dist.all_reduce(torch.ones(4)), repeats=3, warmup=1, device=helpers.rank_device())
    dist.destroy_process_group()
    return len(times)


def test_time_steps_with_a_barrier_on_real_ranks():
    assert helpers.launch(_timed_on_ranks, world_size=2, timeout=120, quiet=True) == [3, 3]
