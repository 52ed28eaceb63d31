"""The appendix's figure: each numeric piece of advice, what this machine measured against what was claimed.

Takes the appendix's `helpers.measure.advice.Judged` rows and returns the Figure; measures nothing.
"""
from __future__ import annotations

from helpers.plots import new_figure

COLOURS = {"holds": "tab:green", "exceeds the claim": "tab:blue", "does not hold": "tab:red", "inconclusive": "tab:orange",
           "not comparable here": "tab:gray"}


def claim_edge(row) -> float | None:
    """The number a row's measurement is divided by: the claim's low end, or its high end for an 'at most' claim
    (low 0); None where the row has no positive edge."""
    if row.value is None or not row.claim or row.value <= 0:
        return None
    low, high = row.claim
    edge = low if low and low > 0 else high
    return edge if edge and edge > 0 else None


def measured_against_claims(rows):
    """One line per row with a number and a positive claim edge: the measurement over that edge (log scale; 1 is
    the edge, a tick marks a range's high end), its noise interval as a bar, coloured by the verdict."""
    shown = [r for r in rows if claim_edge(r)]
    fig, (ax,) = new_figure(width=8.0, height=0.3 * max(len(shown), 4) + 1.2)
    for i, r in enumerate(shown):
        edge = claim_edge(r)
        if r.spread and min(r.spread) > 0:
            ax.plot([min(r.spread) / edge, max(r.spread) / edge], [i, i], color=COLOURS[r.answer], linewidth=3,
                    alpha=0.4)
        ax.plot([r.value / edge], [i], "o", color=COLOURS[r.answer])
        high = r.claim[1]
        if high not in (None, r.claim[0]) and edge == r.claim[0]:
            ax.plot([high / edge], [i], "|", color="black", markersize=10)
    ax.axvline(1, color="black", linewidth=0.8)
    labels = [f"{r.slug}: {r.advice[:40]}{'…' * (len(r.advice) > 40)}" for r in shown]
    ax.set_yticks(range(len(shown)), labels, fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("measured / the claim's edge (its low end; its high end for an 'at most' claim)")
    for answer, colour in COLOURS.items():
        ax.plot([], [], "o", color=colour, label=answer)
    ax.legend(fontsize=8, loc="best")
    return fig
