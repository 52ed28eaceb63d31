"""Each notebook executed in smoke mode at most once a session, by whichever test asks first (`SmokeRuns`, the
fixture `smoke_runs` of tests/notebooks/conftest.py).

test_notebooks.py checks that a notebook's smoke run raises nothing; test_site.py builds the site from one smoke run
and reads it in a browser. Both ask for the session's run, so a notebook both need runs once, in any order and on
any worker. A module of its own, not conftest.py: `from conftest import` finds whichever conftest.py pytest imported
last."""
from __future__ import annotations

import fcntl
import json
from pathlib import Path

import pytest

from helpers.paths import OUTPUTS

# ten times the slowest smoke run here (09: 301 s, the 2-core machine at a load near 18)
NOTEBOOK_TIMEOUT_S = 3600


class SmokeRuns:
    """Executed copies of notebooks in smoke mode (in outputs/smoke/, as `./cookbook notebooks` with SMOKE=1 writes
    them), one run per notebook per session.

    Under pytest-xdist the session's workers share `folder` (the run's temporary folder, above each worker's own):
    a lock file per notebook makes a second test that asks wait for the first one's run to end, then read its
    record, rather than run the notebook again. A run that failed fails every test that asks, with its error."""

    def __init__(self, folder: Path, out_dir: Path = OUTPUTS / "smoke"):
        self.folder, self.out_dir = folder, out_dir

    def executed(self, path: Path, asked_by: str) -> tuple[Path, str]:
        """The executed copy of `path` and the test whose run made it (`asked_by` when this call ran it)."""
        from tools.run_notebooks import execute_notebook

        record = self.folder / f"{path.stem}.json"
        with open(self.folder / f"{path.stem}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
            if not record.exists():
                try:
                    out, seconds = execute_notebook(path, smoke=True, out_dir=self.out_dir,
                                                    cell_timeout=NOTEBOOK_TIMEOUT_S)
                except BaseException as exc:  # a failed cell, a timeout: the same verdict for every test that asks
                    record.write_text(json.dumps({"by": asked_by, "error": f"{type(exc).__name__}: {exc}"[-6000:]}))
                    raise
                record.write_text(json.dumps({"by": asked_by, "executed": str(out), "seconds": seconds}))
                print(f"{path.name}: executed in {seconds:.1f} s")
        made = json.loads(record.read_text())
        if "error" in made:
            pytest.fail(f"{path.name}'s smoke run in this session, made by {made['by']}, failed:\n{made['error']}")
        return Path(made["executed"]), made["by"]
