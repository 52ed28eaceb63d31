"""Jupyter's interrupt button, for the launcher's tests (test_launch.py, test_workers.py).

A module of its own, not tests/conftest.py: a launched function defined in a test module is sent to the ranks by
reference to that module, so each rank imports the test module, and `from conftest import` there would find whichever
conftest.py pytest put first on sys.path (tests/recipe has one too)."""
from __future__ import annotations

import _thread
import contextlib
import signal
import threading
import time


@contextlib.contextmanager
def cell_interrupted_when(condition, timeout: float):
    """What Jupyter's interrupt button does to the kernel, as soon as `condition()` holds (looked at every 0.05 s)
    or `timeout` seconds into the block, whichever comes first.

    A kernel turns SIGINT into KeyboardInterrupt; a test runner started in the background may have inherited
    SIGINT as ignored, and then interrupt_main() does nothing. The block gets the kernel's handler.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    stop = threading.Event()

    def interrupt_when_ready():
        deadline = time.monotonic() + timeout
        while not stop.wait(0.05):
            if condition() or time.monotonic() > deadline:
                _thread.interrupt_main()
                return

    watcher = threading.Thread(target=interrupt_when_ready, daemon=True)
    try:
        watcher.start()
        yield
    finally:
        stop.set()
        watcher.join()
        signal.signal(signal.SIGINT, previous)


def cell_interrupted_after(seconds: float):
    """The interrupt button pressed `seconds` into the block."""
    return cell_interrupted_when(lambda: False, seconds)
