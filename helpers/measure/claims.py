"""Comparing a measurement with an article's claim: one verdict, worded the same in every notebook.

Why a module: every notebook prints a claim from the articles beside what this machine measured, and the verdict
must be computed, never typed. One function keeps the rule (a claimed range, an optional tolerance, open-ended
claims such as "1.5x or more", claims that cannot apply on this hardware) and the wording in one place, so the
notebooks can print the wording's first word: 'within', 'below', 'above', 'inconclusive', 'not measured',
'not comparable'.

Noise: a measured ratio is a median over repeats, and a reader's machine is busy. Given the interval the repeats
support (`spread=(low, high)`, e.g. `median_interval(samples)` or the min-max of a ratio taken side by side), a
verdict is 'within', 'below' or 'above' only when the whole interval lies there; an interval that straddles one of
the claim's boundaries gives 'inconclusive', with the interval printed. A notebook therefore never asserts a
verdict's outcome (that would fix a noisy result in advance); it asserts properties of what was measured.
"""
from __future__ import annotations

import math
import random
import statistics


def claim_text(low: float, high: float | None, unit: str = "") -> str:
    """The claim as printed: '18%', '2-3x', '1.5x or more' (high=None: open-ended)."""
    if high is None:
        return f"{low:g}{unit} or more"
    if high == low:
        return f"{low:g}{unit}"
    return f"{low:g}-{high:g}{unit}"


def median_interval(samples, confidence: float = 0.9, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A bootstrap interval of the median of `samples` (percentile method, seeded so a re-run prints the same).

    With fewer than 3 samples there is nothing to resample: the min-max range is returned.
    """
    values = [float(v) for v in samples]
    if not values:
        raise ValueError("no samples")
    if len(values) < 3:
        return min(values), max(values)
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1 - confidence) / 2
    return medians[int(tail * (resamples - 1))], medians[int((1 - tail) * (resamples - 1))]


def verdict(measured: float | None, low: float, high: float | None, *, slack: float | tuple[float, float] = 0.0,
            unit: str = "", applicable: bool = True, reason: str = "",
            spread: tuple[float, float] | None = None) -> str:
    """Where `measured` falls against the claimed range [low, high] (same unit; high=None: no upper end).

    slack: a tolerance either side, or (below, above), for claims quoted as a single rounded figure; a value
    inside the tolerance but outside the range says so. applicable=False: the claim's conditions do not hold on
    this machine (`reason` says why: the claim's setting beside this machine's), whatever was measured.
    spread: the interval the measurement's noise allows (same unit); where it straddles a boundary of the claim
    (widened by the tolerance) the verdict is 'inconclusive'. Returns a sentence starting with 'within', 'below',
    'above', 'inconclusive', 'not measured here' or 'not comparable here'.
    """
    if not applicable:
        return f"not comparable here: {reason or 'the claim was made for a setting this machine does not have'}"
    if measured is None or not math.isfinite(measured):
        return "not measured here"
    below, above = slack if isinstance(slack, tuple) else (slack, slack)
    claim = claim_text(low, high, unit)
    if spread is not None:
        lo, hi = sorted(float(v) for v in spread)
        edges = [low - below] + ([] if high is None else [high + above])
        if any(lo < edge < hi for edge in edges):
            return (f"inconclusive: the measurement's noise allows {lo:.3g}-{hi:.3g}{unit}, which straddles the "
                    f"edge of the claimed {claim}")
    if low <= measured and (high is None or measured <= high):
        return f"within the claimed {claim}"
    if low - below <= measured and (high is None or measured <= high + above):
        tolerance = f"±{below:g}{unit}" if below == above else f"-{below:g}/+{above:g}{unit}"
        return f"within the claimed {claim}, given the tolerance {tolerance}"
    end = "it" if high == low else ("its low end" if measured < low else "its high end")
    if measured < low:
        factor = f" ({low / measured:.3g}x under {end})" if measured > 0 and low > 0 else ""
        return f"below the claimed {claim}{factor}"
    factor = f" ({measured / high:.3g}x over {end})" if high > 0 else ""
    return f"above the claimed {claim}{factor}"
