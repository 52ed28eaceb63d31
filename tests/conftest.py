"""No test may leave a process behind; launcher tests also must leave signal handlers and environment as they were."""
from __future__ import annotations

import os
import signal

import psutil
import pytest

WATCHED_SIGNALS = [s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGCHLD", None),
                               getattr(signal, "SIGUSR1", None), getattr(signal, "SIGPIPE", None)) if s is not None]
# Libraries set these on first use (torch's inductor cache, pytest itself): not the launcher's doing.
IGNORED_ENV = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"}


def _environment() -> dict:
    return {k: v for k, v in os.environ.items() if k not in IGNORED_ENV}


@pytest.fixture(autouse=True)
def leaves_no_process():
    yield
    left = psutil.Process().children(recursive=True)
    assert not left, f"processes left behind: {[(p.pid, p.status()) for p in left]}"


@pytest.fixture(autouse=True)
def launcher_leaves_kernel_as_it_was(request):
    if request.node.path.name != "test_launch.py":
        yield
        return
    env_before = _environment()
    handlers_before = {s: signal.getsignal(s) for s in WATCHED_SIGNALS}
    yield
    assert {s: signal.getsignal(s) for s in WATCHED_SIGNALS} == handlers_before, "signal handlers changed"
    assert _environment() == env_before, "the kernel's environment changed"
