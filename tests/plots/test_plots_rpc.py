"""helpers.plots.rpc: the comparison draws every run in every panel; compression draws one bar per codec."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from helpers.plots import rpc  # noqa: E402


def _run(updates, stale):
    curve = [{"update": u, "time": u / 10, "accuracy": 0.1 + u / 200, "loss": 2.0 / (1 + u)} for u in range(0, updates, 10)]
    return {"curve": curve, "staleness": stale, "updates": updates, "wall": updates / 10}


def test_ps_comparison_panels():
    fig = rpc.ps_comparison({"sync": _run(50, [0] * 50), "async": _run(100, [0, 1, 1, 2] * 25)})
    acc_time, acc_update, stale, loss_time, loss_update, rate = fig.axes
    for ax in (acc_time, acc_update, loss_time, loss_update):
        assert len(ax.lines) == 2
    assert list(acc_update.lines[1].get_xdata()) == list(range(0, 100, 10))
    assert len(stale.patches) == 1 + 3  # sync: staleness 0 only; async: 0, 1, 2
    heights = sorted(p.get_height() for p in stale.patches)
    assert heights == [0.25, 0.25, 0.5, 1.0]
    assert [p.get_height() for p in rate.patches] == [10.0, 10.0]
    assert loss_time.get_yscale() == "log"


def test_compression_bars():
    rows = [{"codec": "fp32", "bytes_per_update": 4000, "accuracy": 0.95},
            {"codec": "top-1%", "bytes_per_update": 80, "accuracy": 0.9}]
    sent, acc = rpc.compression(rows).axes
    assert [p.get_height() for p in sent.patches] == [4000, 80] and sent.get_yscale() == "log"
    assert [p.get_height() for p in acc.patches] == [0.95, 0.9]
