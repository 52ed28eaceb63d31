"""No test may leave a process behind; launcher tests also must leave signal handlers and environment as they were.

The launcher's fork-server is the one process allowed to outlive a test (it is started once and reused, as in a
kernel); its workers are not. It is started before the first test, so no launch's timing includes its start, and
stopped after the last one."""
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


@pytest.fixture(scope="session", autouse=True)
def fork_server():
    from helpers.launcher import server

    server.start_server().wait_ready()
    yield
    server.stop_server()


def _server_pid():
    from helpers.launcher import server

    current = server.current_server()
    return current.pid if current is not None else None


@pytest.fixture(autouse=True)
def leaves_no_process():
    yield
    left = [p for p in psutil.Process().children(recursive=True) if p.pid != _server_pid()]
    if left:  # a worker's exit is reaped by the server a moment after the launch returns
        psutil.wait_procs(left, timeout=2)
        left = [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
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
