"""Explorers: a Run button over a plain function that the notebook has just called with its defaults.

Why this shape: where a reader would otherwise edit a number and re-run a cell (a message size, a bucket size, a
world size, a micro-batch count), a control is quicker. But a slider that launches workers on every tick would
start a job per tick, so an explorer is ipywidgets' `interactive` in manual mode: pick values, press Run.

Headless execution (papermill, CI) cannot press buttons, so the notebook first calls the same plain function once
with its default values; that call is what CI runs and what an executed notebook shows. `explore` then checks
that every control names one of the function's parameters and opens at that parameter's default, so the panel
starts exactly where the cell's call was and a control cannot silently drift from the code it drives (ipywidgets
itself quietly picks the first option when a default is not among them).

    def bucket_overlap(bucket_mb=25, world_size=2): ...
    bucket_overlap()                                      # what CI runs
    explore(bucket_overlap, bucket_mb=[1, 5, 25, 100])    # what a reader clicks

A control is anything ipywidgets' `interact` accepts: a list of options (a dropdown), a `(min, max, step)` tuple
(a slider), or a widget. Parameters without a control keep their defaults.
"""
from __future__ import annotations

import inspect


def explore(fn, /, **controls):
    """Display `fn`'s controls with a Run button; each press calls `fn` with the chosen values (output below it).

    Returns the `ipywidgets.interactive` panel (its `.kwargs` are the chosen values, `.update()` runs it), wrapped
    so that `explore(...)` as a cell's last line does not show the panel a second time.
    Raises ValueError when a control names no parameter of `fn`, names one without a default, or cannot show
    that default.
    """
    import ipywidgets
    from IPython.display import display

    if not controls:
        raise ValueError(f"explore({fn.__name__}) needs at least one control, e.g. explore(fn, size=[1, 2, 4])")
    parameters = inspect.signature(fn).parameters
    widgets = {}
    for name, control in controls.items():
        parameter = parameters.get(name)
        if parameter is None or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise ValueError(f"{fn.__name__}() has no parameter {name!r}; its parameters: {', '.join(parameters)}")
        if parameter.default is parameter.empty:
            raise ValueError(f"{fn.__name__}(): give {name!r} a default value, the one the notebook's own call "
                             "uses, so the explorer opens where that call was")
        widget = ipywidgets.interactive.widget_from_abbrev(control, parameter.default)
        if widget is None or widget.value != parameter.default:
            shown = "nothing" if widget is None else repr(widget.value)
            raise ValueError(f"the control for {name!r} ({control!r}) cannot show {fn.__name__}()'s default "
                             f"{parameter.default!r} (it would show {shown}): include the default among its values")
        widget.description = name
        widget.style.description_width = "initial"  # the whole parameter name, not cut to fit a fixed width
        widgets[name] = widget
    for name, parameter in parameters.items():  # left as they are, not turned into widgets by ipywidgets
        if name not in widgets and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD) \
                and parameter.default is not parameter.empty:
            widgets[name] = ipywidgets.fixed(parameter.default)
    panel = ipywidgets.interactive(fn, {"manual": True, "manual_name": "Run"}, **widgets)
    display(panel)
    return Explorer(panel)


class Explorer:
    """The panel `explore` displayed, whose attributes it passes through; displaying it again shows nothing."""

    def __init__(self, panel):
        self.panel = panel

    def __getattr__(self, name):
        return getattr(self.panel, name)

    def _ipython_display_(self):
        pass  # already displayed by explore(); a cell ending in explore(...) would otherwise show it twice
