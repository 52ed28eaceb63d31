"""A finished gloo run must not abort because its group was freed on gloo's own thread.

What CI hit once, in notebook 02b's PowerSGD run on a busy machine: every step done, the result written, then rank 0
died of SIGABRT, "terminate called after throwing an instance of 'std::system_error' / Resource deadlock avoided".
A comm hook's future callbacks hold the process group; gloo runs them, and frees them, on one of its worker threads,
a little after the step that waited on them. When the main thread had meanwhile called destroy_process_group() and
dropped its own references, the callback held the last one, and the group's destructor ran on that worker thread,
where it joins every worker thread: itself. scripts/train/distributed.py (notebook 02's cells) keeps the group it
joined last referenced until it joins the next one or ends (GROUPS_JOINED), so the destructor never runs there.

The race is made certain here: the callback's closure holds the group through an object whose __del__, on the
worker thread, waits until the main thread has destroyed the process group before letting go of it. With the
module's reference the run ends cleanly; with the reference taken away (the code before the fix), the same run
aborts with CI's message: the test can fail.
"""
from __future__ import annotations

import sys
import threading
import time

import pytest

from helpers import launch
from helpers.devices import CPU_ONLY_ENV
from helpers.launcher.errors import WorkerError
from helpers.paths import SCRIPTS

if str(SCRIPTS / "train") not in sys.path:  # the recipe's modules, imported by name as the notebooks do
    sys.path.insert(0, str(SCRIPTS / "train"))

from distributed import run_distributed  # noqa: E402


RELEASED = threading.Event()   # set in a rank once the callback's hold on the group is gone


class HoldsTheGroup:
    """What a comm hook's callback holds: the process group. Freed on gloo's worker thread with the callback, it lets
    go of the group only once the main thread has destroyed the process group (a condition, not a delay): then its
    reference is the group's last unless something else holds it."""

    def __init__(self, group):
        self.group = group

    def __del__(self):
        import torch.distributed as dist

        deadline = time.monotonic() + 60
        while dist.is_initialized() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.group = None        # the last reference, without the module's: the group is destroyed on this thread
        RELEASED.set()


def callback_holds_the_group_longest(device, drop_module_reference: bool):
    """One all-reduce whose future callback (as a comm hook's) holds the group; returns the sum."""
    import torch
    import torch.distributed as dist

    import distributed

    if drop_module_reference:  # the code before the fix: nothing but the callback outlives destroy_process_group()
        distributed.GROUPS_JOINED.clear()
    holder = HoldsTheGroup(dist.group.WORLD)
    values = torch.ones(4)
    done = dist.all_reduce(values, async_op=True).get_future().then(lambda fut, holder=holder: fut.value())
    del holder
    done.wait()
    return values.sum().item()


def run_and_go_on(drop_module_reference: bool):
    """run_distributed, then this process goes on (a script's next lines, the launcher writing the result) until the
    worker thread has let go of the group."""
    total = run_distributed(callback_holds_the_group_longest, drop_module_reference)
    assert RELEASED.wait(60), "the callback was never freed"
    return total


@pytest.mark.timeout(180)
def test_a_group_held_by_a_callback_is_not_freed_on_gloos_thread():
    assert launch(run_and_go_on, False, world_size=2, timeout=120, quiet=True, env=CPU_ONLY_ENV) == [8.0, 8.0]


@pytest.mark.timeout(180)
def test_without_the_modules_reference_the_same_run_aborts():
    with pytest.raises(WorkerError) as failed:
        launch(run_and_go_on, True, world_size=2, timeout=120, quiet=True, env=CPU_ONLY_ENV)
    assert "SIGABRT" in str(failed.value) and "Resource deadlock avoided" in str(failed.value)


def join_three_times():
    """run_distributed three times in one process (a persistent rank, a notebook's pool): each join replaces the
    group held before (freed then, by this thread: its callbacks long done), so they do not pile up."""
    import torch.distributed as dist

    import distributed

    def held_is_the_joined_group(device):
        return len(distributed.GROUPS_JOINED) == 1 and distributed.GROUPS_JOINED[0] is dist.group.WORLD

    return [run_distributed(held_is_the_joined_group) for _ in range(3)] + [len(distributed.GROUPS_JOINED)]


@pytest.mark.timeout(180)
def test_a_process_that_joins_again_holds_only_its_last_group():
    ranks = launch(join_three_times, world_size=2, timeout=120, quiet=True, env=CPU_ONLY_ENV)
    assert ranks == [[True, True, True, 1]] * 2
