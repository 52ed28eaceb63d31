"""What pytest tells tools/suite.py (`./cookbook test`) about a run: each test's time, its CPU, and what -m or -k left
out.

Loaded with `-p tools.suite_plugin` by tools/suite.py, which names the file to write in COOKBOOK_SUITE_REPORT; with
no such variable it does nothing. Under pytest-xdist the controller writes the file: it receives every test's
reports (each carries its CPU, measured in the worker that ran it), and each worker sends what its collection left
out (all workers collect the same tests) in its `workeroutput`. The JSON written:
  durations   test id -> seconds of its setup, call and teardown together
  cpu         test id -> [user, system] CPU seconds over the same span (`TreeCpu`)
  collected   test file -> how many tests it holds (before -m and -k)
  left_out    test file -> how many of them -m or -k deselected

A test's CPU is what the process running it and every process below it spent from just before its setup to just
after its teardown: that process itself, the children it reaped, and each descendant still running (the launcher's
fork-server, a notebook kernel, JupyterLab, Chromium) with the children that one reaped (the fork-server's workers,
a kernel's own launches). A descendant that ends during a test moves from the last sum to the first with what it
spent, so nothing counts twice and nothing spent in a test is lost; a session-scoped fixture counts in the test whose
setup made it (and its teardown in the last one's). Not counted: a process that left the tree (re-parented to
tools/suite.py, which counts it in the suite's total only).
"""
from __future__ import annotations

import json
import os
import resource
from collections import Counter, defaultdict
from pathlib import Path

import pytest

REPORT_VAR = "COOKBOOK_SUITE_REPORT"
_KEY = "cookbook_suite_collection"
_CPU_BEFORE = pytest.StashKey[tuple]()
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class _Run:
    def __init__(self):
        self.durations: Counter = Counter()
        self.cpu: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        self.deselected: Counter = Counter()
        self.collection: dict | None = None


_run = _Run()


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


class TreeCpu:
    """User and system CPU seconds of this process's whole tree so far: `now()` before and after a test, the
    difference is the test's."""

    @staticmethod
    def now() -> tuple[float, float]:
        own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        user, system = own.ru_utime + reaped.ru_utime, own.ru_stime + reaped.ru_stime
        for u, s in TreeCpu.descendants():
            user, system = user + u, system + s
        return user, system

    @staticmethod
    def descendants() -> list[tuple[float, float]]:
        """(user, system) of each live descendant, each with the children it reaped. Linux's /proc children lists
        (one short file per thread), else psutil's walk over every process of the machine."""
        if Path(f"/proc/self/task/{os.getpid()}/children").exists():
            return [times for pid in _proc_descendants(os.getpid()) if (times := _proc_times(pid)) is not None]
        import psutil

        out = []
        for p in psutil.Process().children(recursive=True):
            try:
                t = p.cpu_times()
            except psutil.Error:  # ended meanwhile: its parent's sum holds it once reaped
                continue
            out.append((t.user + t.children_user, t.system + t.children_system))
        return out


def _proc_descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                children = [int(c) for c in Path(f"/proc/{parent}/task/{tid}/children").read_text().split()]
            except (OSError, ValueError):
                continue
            found += children
            todo += children
    return found


def _proc_times(pid: int) -> tuple[float, float] | None:
    """utime + cutime, stime + cstime of /proc/PID/stat (fields 14-17; the name in parentheses may hold spaces)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # fields from the 3rd on
    utime, stime, cutime, cstime = (int(f) / _TICKS for f in fields[11:15])
    return utime + cutime, stime + cstime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The tree's CPU as the test begins (only when tools/suite.py asked for a report: its workers inherit the
    variable)."""
    if os.environ.get(REPORT_VAR):
        item.stash[_CPU_BEFORE] = TreeCpu.now()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """The teardown's report carries the tree's CPU since the test began, the whole test's (`cpu_user`,
    `cpu_system`: pytest-xdist passes a report's extra attributes on to the controller)."""
    outcome = yield
    before = item.stash.get(_CPU_BEFORE, None)
    if before is None or call.when != "teardown":
        return
    user, system = TreeCpu.now()
    report = outcome.get_result()
    report.cpu_user, report.cpu_system = user - before[0], system - before[1]


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
    if report.when == "teardown" and hasattr(report, "cpu_user"):
        _run.cpu[report.nodeid] = [report.cpu_user, report.cpu_system]


def pytest_sessionfinish(session):
    path = os.environ.get(REPORT_VAR)
    if not path or hasattr(session.config, "workerinput"):
        return
    collection = _run.collection or {"collected": {}, "left_out": {}}
    with open(path, "w") as f:
        json.dump({"durations": dict(_run.durations), "cpu": dict(_run.cpu), **collection}, f)
