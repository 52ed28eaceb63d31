"""The appendix's figure: each numeric piece of advice, what this machine measured against what was claimed.

Takes the appendix's `helpers.measure.advice.Judged` rows and returns the Figure; measures nothing.
"""
from __future__ import annotations

from helpers.plots import new_figure

COLOURS = {"holds": "tab:green", "does not hold": "tab:red", "inconclusive": "tab:orange",
           "not comparable here": "tab:gray"}


def measured_against_claims(rows):
    """One line per row that has a number and a claim: the measurement divided by the claim's low end (log
    scale; 1 is the claim's edge), with the noise interval as an error bar, coloured by the verdict."""
    shown = [r for r in rows if r.value is not None and r.claim and r.claim[0] not in (0, None)
             and r.value > 0 and r.claim[0] > 0]
    fig, (ax,) = new_figure(width=7.0, height=0.32 * max(len(shown), 4) + 1.2)
    for i, r in enumerate(shown):
        low = r.claim[0]
        x = r.value / low
        if r.spread:
            lo, hi = sorted(r.spread)
            if lo > 0:
                ax.plot([lo / low, hi / low], [i, i], color=COLOURS[r.answer], linewidth=3, alpha=0.4)
        ax.plot([x], [i], "o", color=COLOURS[r.answer])
        if r.claim[1] not in (None, low):
            ax.plot([1, r.claim[1] / low], [i, i], "|", color="black", markersize=10)
    ax.axvline(1, color="black", linewidth=0.8)
    ax.set_yticks(range(len(shown)), [r.slug for r in shown], fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("measured / the claim's low end (1 = the claim's edge; ticks: its high end)")
    for answer, colour in COLOURS.items():
        ax.plot([], [], "o", color=colour, label=answer)
    ax.legend(fontsize=8, loc="best")
    return fig
