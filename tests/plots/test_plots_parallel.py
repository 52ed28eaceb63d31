"""The parallelism figures draw what they are given: owners per element, one bar per strategy, one point per run."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from helpers.plots import parallel as parallel_plots  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    """Each test's figures closed after it: pyplot keeps every figure open until told, and warns past twenty."""
    yield
    plt.close("all")


def _two_by_two():
    # a 4 x 2 weight: rows 0-1 on ranks 0 and 1 (replicated), rows 2-3 split by column between ranks 2 and 3
    owners = {0: [0, 1, 2, 3], 1: [0, 1, 2, 3], 2: [4, 6], 3: [5, 7]}
    return [{"rank": r, "owners": {"w": torch.tensor(idx)}, "shapes": {"w": (4, 2)}, "placements": {"w": "(?)"}}
            for r, idx in owners.items()]


def test_owner_sets_list_every_rank_holding_an_element():
    assert parallel_plots.owner_sets(_two_by_two(), "w") == [(0, 1)] * 4 + [(2,), (3,), (2,), (3,)]


def test_shard_owners_one_panel_per_parameter_and_one_legend_entry_per_owner_set():
    fig = parallel_plots.shard_owners(_two_by_two(), ["w"])
    assert len(fig.axes) == 1 and fig.axes[0].images[0].get_array().shape == (4, 2)
    assert len(fig.legends[0].get_texts()) == 3


def test_step_times_bubble_and_timeline():
    fig = parallel_plots.step_times({"TP": {"seconds": [0.1, 0.2, 0.3], "bytes_sent": 2**20},
                                     "FSDP": {"seconds": [0.2], "bytes_sent": 2**21}})
    assert [len(ax.patches) for ax in fig.axes] == [2, 2]
    rows = [{"schedule": "gpipe", "m": m, "counted": 1 / (m + 1), "formula": 1 / (m + 1), "measured": 0.5}
            for m in (1, 2, 4)]
    fig = parallel_plots.bubble(rows)
    assert len(fig.axes[0].lines) == 3 and list(fig.axes[0].lines[1].get_xdata()) == [1, 2, 4]
    fig = parallel_plots.timeline({0: [(0.0, 1.0, "F0"), (1.0, 3.0, "B0")], 1: [(1.0, 2.0, "F0")]})
    assert len(fig.axes[0].patches) == 3


def test_bubble_draws_no_formula_for_a_schedule_it_does_not_describe():
    rows = [{"schedule": "interleaved", "m": m, "counted": 0.2, "formula": 0.2, "measured": 0.3} for m in (2, 4)] + \
        [{"schedule": "zbv", "m": m, "counted": 0.1, "formula": None, "measured": 0.25} for m in (2, 4)]
    lines = parallel_plots.bubble(rows).axes[0].lines
    assert len(lines) == 5  # interleaved: formula, counted, measured; zbv: counted, measured
    assert [list(line.get_ydata()) for line in lines[3:]] == [[0.1, 0.1], [0.25, 0.25]]


def test_memory_against_length_draws_each_series_and_its_prediction():
    fig = parallel_plots.memory_against_length([64, 128, 256], {"one rank": [2**20, 2**21, 2**22],
                                                                "each of 2": [2**19, 2**20, 2**21]},
                                               {"one rank": [2**20, 2**21, 2**22]})
    measured_one, predicted_one, measured_each = fig.axes[0].lines
    assert list(measured_one.get_xdata()) == [64, 128, 256] and list(measured_one.get_ydata()) == [1, 2, 4]
    assert predicted_one.get_linestyle() == "--" and list(measured_each.get_ydata()) == [0.5, 1, 2]


def test_call_bytes_one_bar_per_rank_and_call_with_the_formula_ticked():
    fig = parallel_plots.call_bytes({0: [1024, 2048, 4096], 1: [1024, 3072, 2048]},
                                    {0: [1024, 2048, 4096], 1: [1024, 3072, 1024]}, ["counts", "dispatch", "combine"])
    ax = fig.axes[0]
    assert len(ax.patches) == 6 and [p.get_height() for p in ax.patches[3:]] == [1, 3, 2]
    assert [list(line.get_ydata()) for line in ax.lines] == [[1, 2, 4], [1, 3, 1]]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["counts", "dispatch", "combine"]


def test_bubble_step_draws_the_step_and_the_formula_beside_the_sweep():
    row = {"schedule": "gpipe", "m": 2, "p": 2, "v": 1, "counted": 1 / 3, "formula": 1 / 3, "measured": 0.5,
           "events": {0: [(0.0, 1.0, "F0"), (1.0, 2.0, "F1")], 1: [(1.0, 2.0, "F0")]}}
    sweep = [{"schedule": "gpipe", "m": m, "measured": 0.6} for m in (1, 2, 4)] + \
        [{"schedule": "1f1b", "m": 2, "measured": 0.4}]
    fig = parallel_plots.bubble_step(row, sweep)
    left, right = fig.axes
    assert len(left.patches) == 3
    curve, crosses, counted, star = right.lines
    assert abs(curve.get_ydata()[0] - 0.5) < 1e-12  # (p - 1)/(m + p - 1) at m = 1
    assert list(crosses.get_xdata()) == [1, 2, 4] and list(star.get_ydata()) == [0.5]


def test_show_closes_the_figure_it_displays(capsys):
    import matplotlib.pyplot as plt

    from helpers.plots import new_figure, show

    fig, _ = new_figure()
    show(fig)
    assert fig.number not in plt.get_fignums()  # nothing left open for a later flush to draw again
    assert "Figure" in capsys.readouterr().out  # displayed (outside IPython: its text form)
