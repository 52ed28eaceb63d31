"""The programs that run the project: notebook runner, budget runner, exporter, teaching stats.

Not imported by notebooks (those import `helpers`); each runs as `python -m tools.NAME` from the repository root,
usually through `./cookbook`.
"""
