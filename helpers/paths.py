"""Where the project's folders are, named once: every module that reads notebooks or writes outputs asks here."""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent  # holds helpers/, notebooks/, scripts/, outputs/
NOTEBOOKS = REPO_ROOT / "notebooks"
SCRIPTS = REPO_ROOT / "scripts"
OUTPUTS = REPO_ROOT / "outputs"  # ignored by git: executed notebooks, exported scratch files, screenshots
