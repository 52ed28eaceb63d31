"""Comparing a measurement with an article's claim: one verdict, worded the same in every notebook.

Why a module: every notebook prints a claim from the articles beside what this machine measured, and the verdict
must be computed, never typed. One function keeps the rule (a claimed range, an optional tolerance, open-ended
claims such as "1.5x or more", claims that cannot apply on this hardware) and the wording in one place, so the
notebooks can assert on the wording's first word: 'within', 'below', 'above', 'not measured', 'not applicable'.
"""
from __future__ import annotations

import math


def claim_text(low: float, high: float | None, unit: str = "") -> str:
    """The claim as printed: '18%', '2-3x', '1.5x or more' (high=None: open-ended)."""
    if high is None:
        return f"{low:g}{unit} or more"
    if high == low:
        return f"{low:g}{unit}"
    return f"{low:g}-{high:g}{unit}"


def verdict(measured: float | None, low: float, high: float | None, *, slack: float | tuple[float, float] = 0.0,
            unit: str = "", applicable: bool = True, reason: str = "") -> str:
    """Where `measured` falls against the claimed range [low, high] (same unit; high=None: no upper end).

    slack: a tolerance either side, or (below, above), for claims quoted as a single rounded figure; a value
    inside the tolerance but outside the range says so. applicable=False: the claim's conditions do not hold on
    this machine (`reason` says why), whatever was measured. Returns a sentence starting with 'within', 'below',
    'above', 'not measured here' or 'not applicable here'.
    """
    if not applicable:
        return f"not applicable here: {reason or 'the claim does not apply to this machine'}"
    if measured is None or not math.isfinite(measured):
        return "not measured here"
    below, above = slack if isinstance(slack, tuple) else (slack, slack)
    claim = claim_text(low, high, unit)
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
