"""What the documents quote is in the repository: no page points outside it, and the GPU runs' raw output that
docs/measurements.md cites is committed beside it (docs/gpu-runs/DATE/).

Why: a folder outside the checkout is not in a clone, may not be writable by the project, and was once cited for a
run whose output it never held; a figure must be checkable against the output it was copied from.
"""
from __future__ import annotations

import re
from pathlib import Path

from helpers.paths import REPO_ROOT

DOCS = REPO_ROOT / "docs"
MEASUREMENTS = DOCS / "measurements.md"
# a relative path that climbs: ../x, ../../x/y
_CLIMBING = re.compile(r"(?<![\w./-])((?:\.\./)+[\w./-]*)")
_RUN_FOLDER = re.compile(r"gpu-runs/(\d{4}-\d{2}-\d{2})/")


def documents() -> list[Path]:
    """The repository's Markdown pages (not those inside git's or an environment's folders, nor outputs/)."""
    return sorted(p for p in REPO_ROOT.rglob("*.md")
                  if not any(part.startswith(".") or part == "outputs" for part in p.relative_to(REPO_ROOT).parts))


def test_no_document_points_outside_the_repository():
    """A path that climbs out of its page's folder must land on something the repository holds."""
    outside = [f"{page.relative_to(REPO_ROOT)}: {path}" for page in documents()
               for path in _CLIMBING.findall(page.read_text())
               if not ((target := (page.parent / path).resolve()).is_relative_to(REPO_ROOT) and target.exists())]
    assert not outside, f"paths that leave the repository or lead nowhere in it: {outside}"


def test_every_gpu_run_folder_measurements_cites_is_committed_beside_it():
    cited = set(_RUN_FOLDER.findall(MEASUREMENTS.read_text()))
    assert cited, "docs/measurements.md cites no raw output in docs/gpu-runs/"
    missing = [date for date in sorted(cited) if not any((DOCS / "gpu-runs" / date).glob("*"))]
    assert not missing, f"docs/measurements.md cites docs/gpu-runs/ folders that are missing or empty: {missing}"
