"""The exporter moved to `tools/export.py` (it runs the project; notebooks import `helpers`). This name stays only
while notebook 03's script cell imports `drift` from here; delete it once that cell imports `tools.export`."""
from tools.export import drift

__all__ = ["drift"]
