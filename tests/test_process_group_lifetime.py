"""A finished gloo run must not abort because its group was freed on gloo's own thread.

What CI hit once, in notebook 02b's PowerSGD run on a busy machine: every step done, the result written, then rank 0
died of SIGABRT, "terminate called after throwing an instance of 'std::system_error' / Resource deadlock avoided".
A comm hook's future callbacks hold the process group; gloo runs them, and frees them, on one of its worker threads,
a little after the step that waited on them. When the main thread had meanwhile called destroy_process_group() and
dropped its own references, the callback held the last one, and the group's destructor ran on that worker thread,
where it joins every worker thread: itself. scripts/train/distributed.py (notebook 02's cells) keeps the group it
joined last referenced until it joins the next one or ends (GROUPS_JOINED), so the destructor never runs there.

The race is made certain here: the callback's closure also holds an object whose __del__ sleeps, so the main thread
has long destroyed the group when the worker thread lets go of it. With the module's reference the run ends cleanly;
with the reference taken away (the code before the fix), the same run aborts with CI's message: the test can fail.
"""
from __future__ import annotations

import sys
import time

import pytest

from helpers import launch
from helpers.launcher.errors import WorkerError
from helpers.paths import SCRIPTS

if str(SCRIPTS / "train") not in sys.path:  # the recipe's modules, imported by name as the notebooks do
    sys.path.insert(0, str(SCRIPTS / "train"))

from distributed import run_distributed  # noqa: E402


class SlowToFree:
    """Freed on gloo's worker thread when the callback's closure goes; sleeping there lets the main thread run on."""

    def __del__(self):
        time.sleep(0.5)


def callback_holds_the_group_longest(device, drop_module_reference: bool):
    """One all-reduce whose future callback (as a comm hook's) holds the group and a SlowToFree; returns the sum."""
    import torch
    import torch.distributed as dist

    import distributed

    if drop_module_reference:  # the code before the fix: nothing but the callback outlives destroy_process_group()
        distributed.GROUPS_JOINED.clear()
    group, slow = dist.group.WORLD, SlowToFree()
    values = torch.ones(4)
    done = dist.all_reduce(values, async_op=True, group=group).get_future().then(
        lambda fut, group=group, slow=slow: fut.value())
    del group, slow
    done.wait()
    return values.sum().item()


def run_and_go_on(drop_module_reference: bool):
    """run_distributed, then a second more of this process's life (a script's next lines, the launcher writing the
    result): the time in which the worker thread lets go of the group."""
    total = run_distributed(callback_holds_the_group_longest, drop_module_reference)
    time.sleep(1.0)
    return total


@pytest.mark.timeout(180)
def test_a_group_held_by_a_callback_is_not_freed_on_gloos_thread():
    assert launch(run_and_go_on, False, world_size=2, timeout=120,
                  quiet=True) == [8.0, 8.0]


@pytest.mark.timeout(180)
def test_without_the_modules_reference_the_same_run_aborts():
    with pytest.raises(WorkerError) as failed:
        launch(run_and_go_on, True, world_size=2, timeout=120, quiet=True)
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
    assert launch(join_three_times, world_size=2, timeout=120, quiet=True) == [[True, True, True, 1]] * 2
