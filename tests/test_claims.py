"""helpers.measure.claims: one verdict for every comparison of a measurement with an article's claim."""
from __future__ import annotations

import math

from helpers.measure.claims import claim_text, verdict


def test_claim_text():
    assert claim_text(2, 3, "x") == "2-3x" and claim_text(18, 18, "%") == "18%" and claim_text(1.5, None, "x") == \
        "1.5x or more"


def test_within_below_above_with_factors():
    assert verdict(7, 5, 10).startswith("within")
    assert verdict(17, 15, 20) == "within the claimed 15-20"
    below = verdict(0.5, 5, 10)
    assert below.startswith("below") and "10x under its low end" in below
    above = verdict(40, 5, 10)
    assert above.startswith("above") and "4x over its high end" in above
    assert verdict(10, 15, 20).startswith("below")
    assert "under it)" in verdict(9, 18, 18)


def test_slack_either_side_or_one_side():
    assert verdict(22, 15, 20, slack=3) == "within the claimed 15-20, given the tolerance ±3"
    assert verdict(13, 15, 20, slack=3).startswith("within")
    assert verdict(30, 15, 20, slack=3).startswith("above")
    assert verdict(11, 15, 20, slack=3).startswith("below")
    assert verdict(3.2, 2, 3, slack=(0, 0.3), unit="x").startswith("within")
    assert verdict(1.9, 2, 3, slack=(0, 0.3), unit="x").startswith("below")
    assert verdict(3.4, 2, 3, slack=(0, 0.3), unit="x").startswith("above")


def test_open_ended_not_measured_not_applicable():
    assert verdict(1.6, 1.5, None, unit="x") == "within the claimed 1.5x or more"
    assert verdict(100.0, 1.5, None).startswith("within")
    assert verdict(1.2, 1.5, None).startswith("below")
    assert verdict(None, 5, 10) == "not measured here"
    assert verdict(math.nan, 5, 10) == "not measured here"
    assert verdict(float("inf"), 5, 10) == "not measured here"
    assert verdict(0.1, 2, 3, applicable=False, reason="no unit") == "not comparable here: no unit"
    assert verdict(0.0, 5, 10) == "below the claimed 5-10"  # no factor from a zero


def test_a_spread_that_straddles_a_boundary_is_inconclusive():
    assert verdict(17, 15, 20, spread=(14, 19)).startswith("inconclusive")
    assert verdict(17, 15, 20, spread=(16, 19)) == "within the claimed 15-20"
    assert verdict(25, 15, 20, spread=(19, 30)).startswith("inconclusive")
    assert verdict(25, 15, 20, spread=(21, 30)).startswith("above")
    # the tolerance widens the claim before the spread is compared with it
    assert verdict(21, 15, 20, slack=3, spread=(20.5, 22.5)).startswith("within")
    assert verdict(1.6, 1.5, None, spread=(1.4, 1.8)).startswith("inconclusive")


def test_a_claim_for_another_setting_is_not_comparable_with_its_reason():
    text = verdict(3.0, 5, 7, applicable=False, reason="claimed on 8 GPUs with NVLink; this machine: 2 CPU cores")
    assert text.startswith("not comparable here") and "8 GPUs" in text


def test_the_median_interval_contains_the_median_and_narrows_with_more_samples():
    import random
    import statistics

    from helpers.measure.claims import median_interval

    rng = random.Random(1)
    few = [rng.gauss(10, 1) for _ in range(7)]
    many = few + [rng.gauss(10, 1) for _ in range(200)]
    lo_few, hi_few = median_interval(few)
    lo_many, hi_many = median_interval(many)
    assert lo_few <= statistics.median(few) <= hi_few
    assert hi_many - lo_many < hi_few - lo_few
    assert median_interval([3.0, 1.0]) == (1.0, 3.0)
