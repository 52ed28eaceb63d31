"""Judging a piece of common advice against what this machine measured: one verdict, worded the same everywhere.

Why a module: the appendix "Common advice, measured" (notebooks/11_common_advice_measured.ipynb) prints, for each
piece of advice that circulates in tutorials and blog posts, the setting it assumes, what this machine measured
and a verdict that is computed, never typed. The rule that turns a measurement and its noise into a verdict, and
its wording, live here once:

- `verdict` places a measured figure against a claimed range [low, high] (open-ended where high is None, a
  tolerance for a figure quoted rounded): 'within', 'below', 'above'; 'inconclusive' where the interval the
  repeats allow (`spread`) straddles an edge of the claim; 'not comparable here' with the reason where the
  advice's setting (8 GPUs, InfiniBand, A100s) is not this machine's. Other measuring modules print it too.
- `judge` turns that placement into the appendix's four answers: 'holds' (within), 'does not hold' (below or
  above), 'inconclusive', 'not comparable here'. `judge_finding` does the same for advice whose test is a yes/no
  finding (an API this torch has, a warning it raises, an exception clause that ran), the finding computed by
  the caller from what it ran.
- `median_interval` is the noise of a median (a seeded bootstrap), shared by every module that times something.

A notebook never asserts a verdict's outcome (that would fix a noisy result in advance); it asserts properties of
what was measured.
"""
from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

ANSWERS = ("holds", "does not hold", "inconclusive", "not comparable here")


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


def answer(placement: str) -> str:
    """The appendix's answer for one of `verdict`'s sentences: within -> holds, below/above -> does not hold."""
    if placement.startswith("within"):
        return "holds"
    if placement.startswith(("below", "above")):
        return "does not hold"
    if placement.startswith("inconclusive"):
        return "inconclusive"
    return "not comparable here"


@dataclass
class Judged:
    """One row of the appendix: the advice, the setting it assumes, what this machine measured, the verdict.

    value and claim (low, high) and spread are kept for the summary figure where the advice is a number."""
    slug: str
    advice: str
    setting: str
    measured: str
    verdict: str
    value: float | None = None
    claim: tuple[float, float | None] | None = None
    spread: tuple[float, float] | None = None

    @property
    def answer(self) -> str:
        return next(a for a in ANSWERS if self.verdict.startswith(a))

    def __str__(self) -> str:
        return (f"advice:   {self.advice}\nsetting:  {self.setting}\nmeasured: {self.measured}\n"
                f"verdict:  {self.verdict}")


def judge(slug: str, advice: str, setting: str, measured: str, value: float | None, low: float,
          high: float | None, **placement) -> Judged:
    """A numeric claim (`value` against [low, high], with `verdict`'s keywords: slack, unit, spread, applicable,
    reason) as a row whose verdict starts with one of ANSWERS, followed by where the value fell."""
    placed = verdict(value, low, high, **placement)
    if placed == "not measured here":
        placed = "not comparable here: not measured on this machine"
    said = answer(placed)
    text = placed if said in ("inconclusive", "not comparable here") else f"{said}: {placed}"
    return Judged(slug, advice, setting, measured, text, value, (low, high), placement.get("spread"))


def judge_finding(slug: str, advice: str, setting: str, measured: str, holds: bool, why: str, *,
                  applicable: bool = True, reason: str = "") -> Judged:
    """Advice whose test is a finding, not a figure: `holds` as computed from what was run, and why."""
    if not applicable:
        return Judged(slug, advice, setting, measured, f"not comparable here: {reason}")
    return Judged(slug, advice, setting, measured, f"{'holds' if holds else 'does not hold'}: {why}")


def summary_table(rows: list[Judged], width: int = 60) -> str:
    """The summary as fixed-width text, one line per judged claim: slug, answer, then advice, setting, measured
    and verdict, each shortened to `width` characters."""
    def cut(text: str) -> str:
        return text if len(text) <= width else text[:width - 1] + "…"

    lines = [f"{'slug':<32} {'answer':<20} advice | setting | measured | verdict"]
    for r in rows:
        lines.append(f"{r.slug:<32} {r.answer:<20} {cut(r.advice)} | {cut(r.setting)} | {cut(r.measured)} | "
                     f"{cut(r.verdict)}")
    return "\n".join(lines)


def answer_counts(rows: list[Judged]) -> dict[str, int]:
    """How many rows got each answer, in ANSWERS' order."""
    return {a: sum(r.answer == a for r in rows) for a in ANSWERS}
