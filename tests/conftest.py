"""Every test must leave the process as it found it: no child process, same signal handlers, same environment."""
from __future__ import annotations

import os
import signal

import psutil
import pytest

WATCHED_SIGNALS = [s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGCHLD", None),
                               getattr(signal, "SIGUSR1", None), getattr(signal, "SIGPIPE", None)) if s is not None]


def leftover_children() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


@pytest.fixture(autouse=True)
def leaves_no_trace():
    env_before = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    handlers_before = {s: signal.getsignal(s) for s in WATCHED_SIGNALS}
    yield
    left = leftover_children()
    assert not left, f"processes left behind: {[(p.pid, p.status()) for p in left]}"
    assert {s: signal.getsignal(s) for s in WATCHED_SIGNALS} == handlers_before, "signal handlers changed"
    assert {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"} == env_before, "the kernel's environment changed"
