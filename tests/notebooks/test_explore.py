"""The explorer opens at the function's defaults, refuses controls that would drift from it, and runs it on Run."""
import pytest

ipywidgets = pytest.importorskip("ipywidgets")

from helpers.explore import explore  # noqa: E402


def sizes(size=4, op="sum", *, repeats=3):
    return {"size": size, "op": op, "repeats": repeats}


def shown(panel):
    """The controls a reader sees, by name (parameters left at their defaults are not controls)."""
    return {widget.description: widget.value for widget in panel.kwargs_widgets
            if not isinstance(widget, ipywidgets.fixed)}


def test_controls_open_at_the_defaults_and_run_passes_the_chosen_values():
    panel = explore(sizes, size=[1, 4, 16], op=["sum", "max"])
    assert shown(panel) == {"size": 4, "op": "sum"}
    assert panel.result is None  # nothing ran: manual mode waits for Run
    panel.children[0].value = 16
    panel.children[1].value = "max"
    panel.update()
    assert panel.result == {"size": 16, "op": "max", "repeats": 3}


def test_a_slider_opens_at_the_default():
    panel = explore(sizes, size=(1, 64, 1))
    assert shown(panel) == {"size": 4}


@pytest.mark.parametrize("controls, message", [
    ({"sise": [1, 4]}, "no parameter 'sise'"),
    ({"size": [1, 2, 8]}, "cannot show sizes()'s default 4"),
    ({"op": ["max", "min"]}, "cannot show sizes()'s default 'sum'"),
    ({}, "needs at least one control"),
])
def test_controls_that_would_drift_from_the_function_are_refused(controls, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        explore(sizes, **controls)


def test_a_parameter_without_default_is_refused():
    def needs(size):
        return size

    with pytest.raises(ValueError, match="give 'size' a default"):
        explore(needs, size=[1, 2])


def test_the_panel_is_displayed_once_even_as_a_cells_last_value():
    from IPython.core.formatters import DisplayFormatter

    explorer = explore(sizes, size=[1, 4, 16])
    assert DisplayFormatter().format(explorer) == ({}, {})  # what IPython's display hook shows for it: nothing
    assert DisplayFormatter().format(explorer.panel) != ({}, {})
    assert explorer.kwargs_widgets == explorer.panel.kwargs_widgets
