"""Headline figures: the few numbers a notebook measured that the run summary should show.

Why a mimetype: `./cookbook notebooks` reads the executed notebooks back and prints a table of these figures, so
they are emitted as a display output with a machine-readable part (application/vnd.cookbook.headline+json) beside
the plain text a reader sees. Nothing is parsed out of prose.
"""
from __future__ import annotations

MIMETYPE = "application/vnd.cookbook.headline+json"


def headline(name: str, value: float, unit: str = "", fmt: str = ".4g") -> float:
    """Show `name: value unit` in the notebook and mark it for the run summary. Returns `value`."""
    text = f"{name}: {value:{fmt}} {unit}".rstrip()
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        print(text)
        return value
    if get_ipython() is None:
        print(text)
        return value
    display({"text/plain": text, MIMETYPE: {"name": name, "value": float(value), "unit": unit}}, raw=True)
    return value


def headlines_of(notebook: dict) -> list[dict]:
    """Every headline figure recorded in an executed notebook (nbformat JSON as a dict)."""
    found = []
    for cell in notebook.get("cells", []):
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if MIMETYPE in data:
                found.append(data[MIMETYPE])
    return found
