"""The notebooks' tests share one smoke run per notebook and session (smoke_runs.py says why and how)."""
from __future__ import annotations

import os

import pytest

from smoke_runs import SmokeRuns


@pytest.fixture(scope="session")
def smoke_runs(tmp_path_factory) -> SmokeRuns:
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "smoke-runs"
    folder.mkdir(exist_ok=True)
    return SmokeRuns(folder)
