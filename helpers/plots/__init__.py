"""Every figure the notebooks draw, one module per topic, so a notebook cell stays one call long.

Why matplotlib with the Agg-safe default: figures must render the same in JupyterLab, under papermill (where they
are stored as PNG in the executed notebook) and in a terminal. Each function takes measured results and returns
the Figure; none measures anything itself.
"""
from __future__ import annotations


def new_figure(ncols: int = 1, width: float = 6.0, height: float = 3.6):
    """A figure with `ncols` axes side by side, in the cookbook's one style."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False, layout="constrained")
    for ax in axes[0]:
        ax.grid(True, alpha=0.3)
    return fig, list(axes[0])


def show(fig) -> None:
    """Display `fig` in the output now, closing it first.

    Why: a figure left open in pyplot is drawn by whatever next flushes pyplot's open figures. Pressing an
    explorer's Run button in JupyterLab (a widget's comm message, not a cell's execution) gave blank or half-drawn
    images that way, whether the function called `plt.show()` or left the figure to ipywidgets, while the same
    figure closed and then displayed came out whole. Closed, it is also not shown a second time at the cell's end.
    """
    import matplotlib.pyplot as plt
    from IPython.display import display

    plt.close(fig)
    display(fig)
