"""The recipe's pipeline bubble (scripts/train/pipeline.py, written by notebook 08): `replay` counts the idle slots
of orders of actions written out by hand, against the closed form `bubble_formula`; `depends_on` says which action
waits on which; `record_actions` names what a stage ran."""
from __future__ import annotations

import math
import sys

import pytest

from helpers.paths import SCRIPTS

if str(SCRIPTS / "train") not in sys.path:  # the recipe's modules, as the notebooks import them
    sys.path.insert(0, str(SCRIPTS / "train"))
from pipeline import bubble_formula, depends_on, record_actions, replay  # noqa: E402


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


def _acts(text: str) -> list:
    """'0F0 0I0 0W0' -> [(0, 'F', 0), (0, 'I', 0), (0, 'W', 0)]."""
    return [(int(a[0]), a[1], int(a[2:])) for a in text.split()]


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("make", [gpipe, one_f_one_b], ids=["gpipe", "1f1b"])
def test_replayed_bubble_is_the_closed_form(make, p, m):
    result = replay(make(p, m))
    assert math.isclose(result["idle_fraction"], bubble_formula(p, m), abs_tol=1e-12)
    assert result["makespan"] == 2 * (m + p - 1)


def test_backward_twice_as_long_keeps_the_fraction():
    assert math.isclose(replay(gpipe(4, 6), backward_cost=2.0)["idle_fraction"], bubble_formula(4, 6))


def test_two_stages_per_rank_idle_by_the_interleaved_formula():
    # 2 ranks, stages 0 and 2 on rank 0, 1 and 3 on rank 1, m = 2: each rank's forwards, then its backwards
    orders = {0: _acts("0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1"), 1: _acts("1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1")}
    assert bubble_formula(2, 2, 2) == 1 / 5 and bubble_formula(4, 8) == 3 / 11 and bubble_formula(4, 8, 2) == 3 / 19
    assert math.isclose(replay(orders)["idle_fraction"], bubble_formula(2, 2, 2), abs_tol=1e-12)
    assert replay(orders)["makespan"] == 10  # 8 slots of work per rank, (p - 1) = 1 slot idle at each end


def test_the_dependencies_of_each_kind_of_action():
    assert depends_on((0, "F", 3), last_stage=3) == []
    assert depends_on((2, "F", 3), last_stage=3) == [(1, "F", 3)]
    assert depends_on((3, "B", 1), last_stage=3) == [(3, "F", 1)]        # the loss: the stage's own forward
    assert depends_on((1, "I", 1), last_stage=3) == [(2, "B", 1), (2, "I", 1)]
    assert depends_on((1, "W", 1), last_stage=3) == [(1, "I", 1)]


def test_an_order_that_cannot_run_is_refused():
    orders = {0: [(0, "B", 0), (0, "F", 0)], 1: [(1, "F", 0), (1, "B", 0)]}
    with pytest.raises(ValueError, match="no rank can proceed"):
        replay(orders)


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
