"""What pytest tells tools/suite.py (`./cookbook test`) about a run: each test's time and what -m or -k left out.

Loaded with `-p tools.suite_plugin` by tools/suite.py, which names the file to write in COOKBOOK_SUITE_REPORT; with
no such variable it does nothing. Under pytest-xdist the controller writes the file: it receives every test's
reports, and each worker sends what its collection left out (all workers collect the same tests) in its
`workeroutput`. The JSON written:
  durations   test id -> seconds of its setup, call and teardown together
  collected   test file -> how many tests it holds (before -m and -k)
  left_out    test file -> how many of them -m or -k deselected
"""
from __future__ import annotations

import json
import os
from collections import Counter

import pytest

REPORT_VAR = "COOKBOOK_SUITE_REPORT"
_KEY = "cookbook_suite_collection"


class _Run:
    def __init__(self):
        self.durations: Counter = Counter()
        self.deselected: Counter = Counter()
        self.collection: dict | None = None


_run = _Run()


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_deselected(items):
    _run.deselected.update(_file_of(item.nodeid) for item in items)


def pytest_collection_finish(session):
    collected = Counter(_file_of(item.nodeid) for item in session.items) + _run.deselected
    _run.collection = {"collected": dict(collected), "left_out": dict(_run.deselected)}
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller writes the report
        workeroutput[_KEY] = _run.collection


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """An xdist worker is done: take its collection's counts (each worker's are the same)."""
    if not (_run.collection or {}).get("collected"):
        _run.collection = getattr(node, "workeroutput", {}).get(_KEY)


def pytest_runtest_logreport(report):
    _run.durations[report.nodeid] += report.duration


def pytest_sessionfinish(session):
    path = os.environ.get(REPORT_VAR)
    if not path or hasattr(session.config, "workerinput"):
        return
    collection = _run.collection or {"collected": {}, "left_out": {}}
    with open(path, "w") as f:
        json.dump({"durations": dict(_run.durations), **collection}, f)
