"""Persistent ranks (`helpers.Workers`) and the `%%distributed` magic: state kept between calls, the launcher's
promises (root cause, stacks at a timeout, no process left) kept too."""
from __future__ import annotations

import os
import time

import psutil
import pytest
from cell_interrupts import cell_interrupted_after
import torch
import torch.distributed as dist

from helpers.launcher import server
from helpers.launcher.errors import LaunchTimeout, WorkerError
from helpers.launcher.workers import Workers, WorkersStopped, distributed_magic


@pytest.fixture
def workers():
    with Workers(2, timeout=60) as w:
        yield w


def _descendants_besides_server():
    current = server.current_server()
    return [p for p in psutil.Process().children(recursive=True) if current is None or p.pid != current.pid]


def test_a_global_one_call_sets_is_there_for_the_next(workers):
    def make():
        global shard
        shard = torch.full((3,), float(os.environ["RANK"]))
        return os.getpid()

    def read():
        return shard.sum().item(), os.getpid()

    pids = workers.run(make)
    assert workers.run(read) == [(0.0, pids[0]), (3.0, pids[1])], "same processes, same namespace"


def test_a_function_written_for_launch_runs_unchanged_again_and_again(workers):
    def all_reduce_once(x):
        dist.init_process_group("gloo")
        t = torch.tensor([x + dist.get_rank()])
        dist.all_reduce(t)
        dist.destroy_process_group()
        return t.item()

    assert [workers.run(all_reduce_once, x) for x in (1.0, 2.0, 3.0)] == [[3.0, 3.0], [5.0, 5.0], [7.0, 7.0]]


def test_a_process_group_can_be_kept_between_calls(workers):
    def join():
        dist.init_process_group("gloo")
        return dist.get_rank()

    def reduce(x):
        t = torch.tensor([x])
        dist.all_reduce(t)
        return t.item()

    assert workers.run(join) == [0, 1]
    assert workers.run(reduce, 2.0) == [4.0, 4.0]
    assert workers.run(reduce, 5.0) == [10.0, 10.0]


def test_the_kernels_globals_are_current_at_each_call(workers):
    global SCALE
    SCALE = 2.0

    def scaled():
        return SCALE * (int(os.environ["RANK"]) + 1)

    assert workers.run(scaled) == [2.0, 4.0]
    SCALE = 10.0
    assert workers.run(scaled) == [10.0, 20.0]


def test_an_error_names_the_rank_and_the_workers_stay_usable(workers):
    def fails():
        if os.environ["RANK"] == "1":
            raise ValueError("bad input on rank 1")
        return "fine"

    with pytest.raises(WorkerError) as info:
        workers.run(fails)
    assert (info.value.rank, info.value.kind) == (1, "ValueError") and info.value.results == {0: "fine"}
    assert workers.alive and workers.run(lambda: int(os.environ["RANK"])) == [0, 1]


def test_a_hang_ends_with_stacks_and_the_workers_say_they_must_be_restarted(workers):
    def hangs():
        if os.environ["RANK"] == "0":
            time.sleep(600)  # rank 0 is stuck here
        return "ok"

    with pytest.raises(LaunchTimeout) as info:
        workers.run(hangs, timeout=3)
    assert set(info.value.stacks) == {0} and "time.sleep(600)  # rank 0 is stuck here" in info.value.stacks[0]
    assert not workers.alive and not _descendants_besides_server()
    with pytest.raises(WorkersStopped, match="restart"):
        workers.run(lambda: 1)
    assert workers.restart().run(lambda: int(os.environ["RANK"])) == [0, 1]


def test_a_rank_that_dies_stops_the_workers(workers):
    def dies():
        if os.environ["RANK"] == "1":
            os._exit(5)
        return "alive"

    with pytest.raises(WorkerError, match="rank 1 died: exited with code 5"):
        workers.run(dies)
    assert not workers.alive and not _descendants_besides_server()


def test_an_interrupted_cell_interrupts_the_ranks_which_stay(workers):
    def long_sleep():
        time.sleep(600)

    with cell_interrupted_after(1.5), pytest.raises(KeyboardInterrupt):
        workers.run(long_sleep)
    assert workers.alive and workers.run(lambda: "still here") == ["still here", "still here"]


def test_close_leaves_no_process():
    w = Workers(2, timeout=60)
    pids = w.pids
    w.close()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    assert not _descendants_besides_server()


def test_the_distributed_magic_runs_a_cell_on_every_rank(capsys):
    try:
        assert distributed_magic("-n 2", "import os\nrank = int(os.environ['RANK'])\nprint('hello from', rank)") \
            is None
        assert distributed_magic("", "rank * 10") == [0, 10], "the next cell sees the last one's names"
        out = capsys.readouterr().out
        assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out
        with pytest.raises(WorkerError) as info:
            distributed_magic("", "1 / (rank - 1)")
        assert info.value.rank == 1 and info.value.kind == "ZeroDivisionError"
        assert "1 / (rank - 1)" in info.value.traceback, "the cell's source line is in the traceback"
        with pytest.raises(SyntaxError):
            distributed_magic("", "def broken(:")
    finally:
        if Workers.current is not None:
            Workers.current.close()


def test_every_call_goes_to_the_same_processes(workers):
    """Fifty calls, one pair of processes: the ranks are kept, not started again (the cost is a benchmark)."""
    pids = {tuple(workers.run(os.getpid)) for _ in range(50)}
    assert len(pids) == 1


def test_what_a_persistent_rank_started_lives_until_the_rank_ends_and_not_longer():
    def start_sleep():
        import subprocess

        global sleeper
        sleeper = subprocess.Popen(["sleep", "300"], start_new_session=True)
        return sleeper.pid

    w = Workers(2, timeout=60)
    try:
        pids = w.run(start_sleep)
        assert all(psutil.pid_exists(p) for p in pids), "a rank's subprocess lives between calls"
    finally:
        w.close()
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive and not server.processes_left()
