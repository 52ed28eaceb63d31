"""Figures of notebook 00: what a launch costs."""
from __future__ import annotations

from helpers.plots import new_figure


def launch_times(results: dict[str, dict]):
    """Median wall time per launcher, with min-max whiskers, on a log axis (they differ by orders of magnitude)."""
    fig, (ax,) = new_figure(width=7.0, height=2.8)
    names = list(results)
    med = [results[n]["median_s"] for n in names]
    lo = [m - results[n]["min_s"] for m, n in zip(med, names)]
    hi = [results[n]["max_s"] - m for m, n in zip(med, names)]
    ax.barh(names, med, xerr=[lo, hi], color="tab:blue", alpha=0.8, capsize=4)
    ax.set_xscale("log")
    ax.set_xlabel("wall time of a trivial 2-rank launch (s, median, min-max)")
    for y, n in enumerate(names):
        ax.text(results[n]["max_s"] * 1.08, y, f"{results[n]['median_s']:.3f} s", va="center")
    ax.set_xlim(right=max(r["max_s"] for r in results.values()) * 4)
    return fig
