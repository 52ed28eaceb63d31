"""The launcher's fault suite: one test per kind of failure, each asserting the message, how soon it came, and
(through conftest's autouse fixture) that no process, signal handler or environment variable is left changed."""
from __future__ import annotations

import _thread
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

import helpers

from helpers import devices
from helpers.launcher.api import ExitHangWarning, LaunchTimeout, WorkerError, launch
from helpers.launcher.progress import RUN_DIR_VAR

from helpers.launcher import api as launch_module


def _init():
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def test_results_come_back_ordered_by_rank_with_torchrun_environment():
    def work(offset):
        rank, world = _init()
        t = torch.tensor([float(rank + offset)])
        dist.all_reduce(t)
        env = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                          "MASTER_ADDR", "MASTER_PORT")}
        dist.destroy_process_group()
        return rank, t.item(), env

    results = launch(work, 10, world_size=3, timeout=60)
    assert [r[0] for r in results] == [0, 1, 2]
    assert all(r[1] == 10 + 11 + 12 for r in results)
    for rank, _, env in results:
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "3"
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_closures_defined_in_a_cell_work_with_either_start_method(start_method):
    scale = 3.0

    def work():
        rank, _ = _init()
        t = torch.tensor([scale * (rank + 1)])
        dist.all_reduce(t)
        dist.destroy_process_group()
        return t.item()

    assert launch(work, world_size=2, start_method=start_method, timeout=120) == [9.0, 9.0]


def test_kwargs_reach_the_function_and_tensors_come_back():
    def work(n, *, fill):
        return torch.full((n,), fill + int(os.environ["RANK"]))

    out = launch(work, 4, fill=7, world_size=2, timeout=60)
    assert torch.equal(out[1], torch.full((4,), 8))


class _TimedStream:
    """Records when each chunk of text reached the kernel's stdout."""

    def __init__(self):
        self.chunks: list[tuple[float, str]] = []

    def write(self, text):
        self.chunks.append((time.monotonic(), text))
        return len(text)

    def flush(self):
        pass

    @property
    def text(self):
        return "".join(t for _, t in self.chunks)


def test_output_is_live_and_prefixed_by_rank(monkeypatch):
    stream = _TimedStream()
    monkeypatch.setattr(sys, "stdout", stream)

    def work():
        print(f"early from {os.environ['RANK']}", flush=True)
        time.sleep(2.0)
        return os.environ["RANK"]

    launch(work, world_size=2, timeout=60)
    returned_at = time.monotonic()
    early = [t for t, text in stream.chunks if "early from" in text]
    assert "[rank 0] early from 0" in stream.text and "[rank 1] early from 1" in stream.text
    assert early and returned_at - min(early) > 1.5, "output arrived only when the workers ended"


def test_large_output_does_not_deadlock(capsys):
    def work():
        line = "x" * 1000
        for i in range(5000):  # 5 MB per rank: far beyond any pipe buffer
            print(f"{i} {line}")
        return "done"

    start = time.monotonic()
    assert launch(work, world_size=2, timeout=120) == ["done", "done"]
    out = capsys.readouterr().out
    assert out.count("[rank 0] ") == 5000 and out.count("[rank 1] ") == 5000
    assert time.monotonic() - start < 60


def test_stderr_is_prefixed_too(capsys):
    def work():
        print("to stderr", file=sys.stderr, flush=True)

    launch(work, world_size=2, timeout=60)
    err = capsys.readouterr().err
    assert "[rank 0] to stderr" in err and "[rank 1] to stderr" in err


def test_root_cause_is_the_rank_that_raised_not_its_peers():
    def work():
        rank, _ = _init()
        if rank == 1:
            raise ValueError("bad shard on purpose")
        dist.barrier()  # rank 0 then fails with "connection closed": a secondary error

    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(work, world_size=3, timeout=60)
    err = info.value
    assert time.monotonic() - start < 15
    assert (err.rank, err.kind, err.message) == (1, "ValueError", "bad shard on purpose")
    assert "in work" in err.traceback and 'raise ValueError("bad shard on purpose")' in err.traceback
    assert isinstance(err.original, ValueError)
    assert str(err).startswith("rank 1 raised ValueError: bad shard on purpose")


def test_a_rank_that_exits_without_an_exception_is_reported_with_its_code():
    def work():
        rank, _ = _init()
        if rank == 0:
            os._exit(3)
        dist.barrier()

    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 0 died: exited with code 3"):
        launch(work, world_size=2, timeout=60)
    assert time.monotonic() - start < 15


def test_a_rank_killed_by_a_signal_is_reported_with_the_signal():
    def work():
        rank, _ = _init()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()

    with pytest.raises(WorkerError, match=r"rank 1 died: killed by signal SIGKILL"):
        launch(work, world_size=2, timeout=60)


def test_sys_exit_is_a_failure_not_a_success():
    def work():
        if os.environ["RANK"] == "0":
            sys.exit(0)
        return "ok"

    with pytest.raises(WorkerError, match=r"rank 0 raised SystemExit: the worker called sys.exit\(0\)"):
        launch(work, world_size=2, timeout=60)


def test_a_rank_that_leaves_while_its_peers_wait_is_an_error():
    def work():
        rank, _ = _init()
        if rank == 0:
            return "left early"
        t = torch.ones(1)
        dist.all_reduce(t)  # rank 0 is gone: this can never complete
        return "never"

    start = time.monotonic()
    with pytest.raises((WorkerError, LaunchTimeout)) as info:
        launch(work, world_size=2, timeout=20)
    assert time.monotonic() - start < 30
    assert "rank 1" in str(info.value)
    assert "returned" in str(info.value)  # the report says rank 0 had already returned


def test_timeout_shows_where_each_rank_was_stuck_and_kills_everything():
    def work():
        rank, _ = _init()
        if rank == 0:
            time.sleep(600)  # never arrives at the barrier
        dist.barrier()

    start = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(work, world_size=2, timeout=4)
    elapsed = time.monotonic() - start
    assert 4 <= elapsed < 12
    stacks = info.value.stacks
    assert set(stacks) == {0, 1}
    assert "in work" in stacks[0] and "time.sleep(600)" not in stacks[0]  # faulthandler shows lines, not code
    assert "in barrier" in stacks[1]
    assert "in _bootstrap" not in stacks[0] and "pytest" not in stacks[0], "the kernel's own frames are trimmed"


def test_grandchildren_of_a_hung_worker_are_stopped_too():
    def work():
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print("grandchild", child.pid, flush=True)
        time.sleep(600)

    with pytest.raises(LaunchTimeout):
        launch(work, world_size=2, timeout=3)
    # conftest's fixture asserts that no descendant of this process survives


def test_interrupting_the_cell_stops_every_worker_and_the_next_launch_works():
    def hang():
        time.sleep(600)

    # A kernel turns SIGINT into KeyboardInterrupt; a test runner started in the background may have inherited
    # SIGINT as ignored, and then interrupt_main() does nothing. Give this test the kernel's handler.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.5, _thread.interrupt_main)
    try:
        timer.start()
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            launch(hang, world_size=2, timeout=30)
    finally:
        timer.cancel()
        timer.join()
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - start < 10
    assert not psutil_children()
    assert launch(lambda: os.environ["RANK"], world_size=2, timeout=60) == ["0", "1"]


def psutil_children():
    import psutil

    return psutil.Process().children(recursive=True)


def test_bad_input_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        launch(print, world_size=0)
    with pytest.raises(TypeError, match="needs a callable"):
        launch("not a function", world_size=2)
    with pytest.raises(ValueError, match="timeout must be a positive"):
        launch(print, world_size=2, timeout=0)
    gpus = devices.gpu_count()
    with pytest.raises(ValueError, match=rf"{gpus + 1} NCCL ranks need {gpus + 1} GPUs"):
        launch(print, world_size=gpus + 1, backend="nccl")
    with pytest.raises(ValueError, match="start_method"):
        launch(print, world_size=2, start_method="forkserver")
    assert not psutil_children()


def test_an_unpicklable_return_value_names_the_rank():
    def work():
        if os.environ["RANK"] == "1":
            return threading.Lock()
        return 1

    with pytest.raises(WorkerError, match=r"rank 1 returned a value that cannot be pickled \(lock\)"):
        launch(work, world_size=2, timeout=60)


def test_fork_is_refused_once_cuda_is_initialised(monkeypatch):
    monkeypatch.setattr(devices, "cuda_initialized", lambda: True)
    assert launch_module.choose_start_method(None) == "spawn"
    with pytest.raises(ValueError, match="initialised CUDA"):
        launch_module.choose_start_method("fork")


def test_default_world_size_without_gpus_is_two(monkeypatch):
    monkeypatch.setattr(devices, "gpu_count", lambda: 0)
    assert launch_module.default_world_size() == 2
    monkeypatch.setattr(devices, "gpu_count", lambda: 1)
    assert launch_module.default_world_size() == 2
    monkeypatch.setattr(devices, "gpu_count", lambda: 4)
    assert launch_module.default_world_size() == 4


def test_single_host_launch_listens_on_loopback_only():
    def work():
        import psutil

        _init()
        t = torch.ones(1)
        dist.all_reduce(t)
        listening = [c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == "LISTEN"]
        dist.destroy_process_group()
        return listening

    for listening in launch(work, world_size=2, timeout=60):
        assert listening, "gloo should listen for its peers"
        assert all(ip in ("127.0.0.1", "::1") for ip in listening), listening


def test_tcp_rendezvous_is_pytorchs_tcpstore():
    def work():
        _init()
        store_type = type(dist.distributed_c10d._get_default_store()).__name__
        dist.destroy_process_group()
        return store_type

    assert launch(work, world_size=2, rendezvous="tcp", timeout=60)[0] in ("TCPStore", "PrefixStore")


def test_reinitialising_the_process_group_inside_one_launch_works():
    def work():
        totals = []
        for _ in range(3):
            _init()
            t = torch.ones(1)
            dist.all_reduce(t)
            totals.append(t.item())
            dist.destroy_process_group()
        return totals

    assert launch(work, world_size=2, timeout=60) == [[2.0] * 3, [2.0] * 3]


def test_backend_choice_reaches_the_workers():
    def work():
        return helpers.default_backend(), str(helpers.rank_device())

    assert launch(work, world_size=2, backend="gloo", timeout=60) == [("gloo", "cpu")] * 2


def test_workers_die_with_a_killed_kernel():
    """A kernel restart is a SIGKILL: no `finally` runs, yet no worker may survive it."""
    import psutil

    kernel = subprocess.Popen(
        [sys.executable, "-c",
         "import os, time, helpers\n"
         "def hang():\n"
         "    print('pid', os.getpid(), flush=True)\n"
         "    time.sleep(600)\n"
         "helpers.launch(hang, world_size=2, timeout=600)\n"],
        stdout=subprocess.PIPE, text=True)
    pids = []
    while len(pids) < 2:
        line = kernel.stdout.readline()
        assert line, "the stand-in kernel ended before its workers started"
        if " pid " in line:
            pids.append(int(line.split()[-1]))
    kernel.kill()
    kernel.wait()
    kernel.stdout.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                                              for p in pids):
        time.sleep(0.1)
    survivors = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert not survivors, f"workers {survivors} outlived their kernel"


def test_forked_workers_survive_a_kernel_that_ran_multithreaded_torch():
    """GNU OpenMP's pool does not survive fork: a forked worker asking for 2+ threads would hang here."""
    a = torch.randn(1500, 1500)
    (a @ a).sum()  # this process now has an OpenMP thread pool (when it has 2+ threads)

    def work():
        b = torch.randn(800, 800)
        (b @ b).sum()
        return torch.get_num_threads()

    assert launch(work, world_size=1, timeout=30) == [1]
    assert launch(work, world_size=1, start_method="spawn", threads=2, timeout=120) == [2]


def test_logging_handlers_made_in_the_kernel_write_to_the_ranks_stream(capsys):
    import logging

    logger = logging.getLogger("cookbook.test.kernel_handler")
    handler = logging.StreamHandler(sys.stderr)  # the kernel's stderr object, inherited by the fork
    logger.addHandler(handler)
    try:
        def work():
            logger.warning("logged in rank %s", os.environ["RANK"])

        launch(work, world_size=2, quiet=True, timeout=60)
        launch(work, world_size=2, timeout=60)
    finally:
        logger.removeHandler(handler)
    err = capsys.readouterr().err
    plain = [line for line in err.splitlines() if line.endswith("logged in rank 0") or line.endswith("rank 1")]
    assert sorted(plain) == ["[rank 0] logged in rank 0", "[rank 1] logged in rank 1"], err  # quiet hid the first


def test_the_results_of_ranks_that_returned_survive_a_failure():
    def work():
        if os.environ["RANK"] == "1":
            raise RuntimeError("trainer crashed")
        return {"server_record": [1, 2, 3]}

    with pytest.raises(WorkerError) as info:
        launch(work, world_size=2, timeout=60)
    assert info.value.results == {0: {"server_record": [1, 2, 3]}}


def test_a_rank_that_hangs_on_its_way_out_is_stopped_and_its_result_kept(monkeypatch):
    # What a gloo process group freed with the GIL held does, now and then, after destroy_process_group.
    monkeypatch.setattr(launch_module, "EXIT_GRACE_S", 1.0)

    class HangsWhenFreed:
        def __del__(self):
            if os.environ["RANK"] == "0":
                time.sleep(600)

    def work():
        held = HangsWhenFreed()  # noqa: F841 - freed when work's locals are
        return int(os.environ["RANK"])

    start = time.monotonic()
    with pytest.warns(ExitHangWarning) as record:
        assert launch(work, world_size=2, timeout=60) == [0, 1]
    assert time.monotonic() - start < 15
    message = str(record[0].message)
    assert message.startswith("rank 0 reported its result") and "in __del__" in message, message


def test_a_functions_objects_are_freed_after_its_result_is_written(tmp_path):
    class Marker:
        def __del__(self):
            written = os.path.exists(os.path.join(os.environ[RUN_DIR_VAR], f"result.{os.environ['RANK']}"))
            (tmp_path / f"freed.{os.environ['RANK']}").write_text(str(written))

    def work():
        marker = Marker()  # noqa: F841
        return "done"

    assert launch(work, world_size=2, timeout=60) == ["done", "done"]
    assert [(tmp_path / f"freed.{r}").read_text() for r in (0, 1)] == ["True", "True"]


def test_the_profile_hook_that_keeps_the_locals_is_gone_before_the_function_runs_on():
    def work():
        return sys.getprofile() is None

    assert launch(work, world_size=1, timeout=60) == [True]


def test_a_rank_that_raised_and_hangs_on_its_way_out_is_still_the_root_cause(monkeypatch):
    monkeypatch.setattr(launch_module, "EXIT_GRACE_S", 1.0)

    class HangsWhenFreed:
        def __del__(self):
            time.sleep(600)

    def work():
        held = HangsWhenFreed()  # noqa: F841
        if os.environ["RANK"] == "1":
            raise ValueError("bad batch")
        return "fine"

    start = time.monotonic()
    with pytest.warns(ExitHangWarning), pytest.raises(WorkerError) as info:
        launch(work, world_size=2, timeout=60)
    assert time.monotonic() - start < 15
    assert (info.value.rank, info.value.kind) == (1, "ValueError")
    assert info.value.results == {0: "fine"}


def test_a_rank_that_aborts_shows_its_last_stderr_lines_even_when_quiet():
    def work():
        if os.environ["RANK"] == "1":
            print("terminate called after throwing an instance of 'gloo::EnforceNotMet'", file=sys.stderr)
            os.abort()  # what a C++ std::terminate does
        return "fine"

    with pytest.raises(WorkerError) as info:
        launch(work, world_size=2, timeout=60, quiet=True)
    message = str(info.value)
    assert message.startswith("rank 1 died: killed by signal SIGABRT"), message
    assert "gloo::EnforceNotMet" in message, "the abort's own message is in the error"
    assert "Fatal Python error: Aborted" in message and "in work" in message, "faulthandler shows where"
