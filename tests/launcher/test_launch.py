"""The launcher's fault suite: one test per kind of failure, each asserting the message, how soon it came, and
(through conftest's autouse fixture) that no process, signal handler or environment variable is left changed.
The fork-server may outlive a test (conftest knows it); its workers may not.

No outcome here rests on the machine's speed. A launch's timeout is ten times or more what its work took on a
loaded 2-core machine (a launch of 2 ranks from the fork-server: about 1 s; through spawn: about 10 s); "soon" means
under half the timeout; a test of what a timeout or an interrupt does waits until the ranks are where they hang
(a file each touches there) before it counts on them being there."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import re
import threading
import time
from pathlib import Path

import pytest
from cell_interrupts import cell_interrupted_when
import torch
import torch.distributed as dist

import helpers
from helpers import devices
from helpers.launcher import api as launch_module
from helpers.launcher import server as server_module
from helpers.launcher import ExitHangWarning, LaunchTimeout, WorkerError, launch
from helpers.launcher.run_folder import RUN_DIR_VAR


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


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_closures_defined_in_a_cell_work_with_either_start_method(start_method):  # spawn: 2 imports of torch
    scale = 3.0

    def work():
        rank, _ = _init()
        t = torch.tensor([scale * (rank + 1)])
        dist.all_reduce(t)
        dist.destroy_process_group()
        return t.item()

    assert launch(work, world_size=2, start_method=start_method, timeout=300) == [9.0, 9.0]


def test_kwargs_reach_the_function_and_tensors_come_back():
    def work(n, *, fill):
        return torch.full((n,), fill + int(os.environ["RANK"]))

    out = launch(work, 4, fill=7, world_size=2, timeout=60)
    assert torch.equal(out[1], torch.full((4,), 8))


class _SeenStream:
    """The kernel's stdout: keeps the text, and touches `seen_dir`/seen.R when rank R's line "early from R" arrives."""

    def __init__(self, seen_dir):
        self.seen_dir, self.chunks = seen_dir, []

    def write(self, text):
        self.chunks.append(text)
        for rank in re.findall(r"^\[rank (\d+)\] early from \1$", self.text, re.M):
            (self.seen_dir / f"seen.{rank}").touch()
        return len(text)

    def flush(self):
        pass

    @property
    def text(self):
        return "".join(self.chunks)


def test_output_is_live_and_prefixed_by_rank(monkeypatch, tmp_path):
    """Each rank prints, then waits until the kernel has shown its line: output that arrived only when the workers
    ended would leave them waiting, and the test failing."""
    stream = _SeenStream(tmp_path)
    monkeypatch.setattr(sys, "stdout", stream)

    def work(seen_dir):
        print(f"early from {os.environ['RANK']}", flush=True)
        seen, deadline = os.path.join(seen_dir, f"seen.{os.environ['RANK']}"), time.monotonic() + 120
        while not os.path.exists(seen) and time.monotonic() < deadline:
            time.sleep(0.05)
        return os.path.exists(seen)

    assert launch(work, str(tmp_path), world_size=2, timeout=300) == [True, True], \
        "the kernel showed a rank's line only after the rank had ended"
    assert "[rank 0] early from 0" in stream.text and "[rank 1] early from 1" in stream.text


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
    assert time.monotonic() - start < 30  # under half the timeout: the failure ended it, not the deadline
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
    assert time.monotonic() - start < 30  # under half the timeout


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
    assert time.monotonic() - start < 20 + 60  # the timeout at the latest, then the stacks and the teardown
    assert "rank 1" in str(info.value)
    assert "returned" in str(info.value)  # the report says rank 0 had already returned


def _there(run_dir: str) -> None:
    """A rank is where it hangs: what _timed_out waits for."""
    open(os.path.join(run_dir, f"there.{os.environ['RANK']}"), "w").close()


def _timed_out(work, run_dir: str, marker: str = "there.{rank}", world_size: int = 2) -> tuple:
    """(the LaunchTimeout, the timeout, the seconds the launch took) of `work(run_dir)`, whose ranks each write
    `marker` where they hang. The timeout starts at 4 s; while some rank had not got there in its first half (a busy
    machine), it is quadrupled and the launch made again, so the ranks are where they hang when it fires."""
    for timeout in (4, 16, 64, 256):
        for old in Path(run_dir).glob(marker.format(rank="*")):
            old.unlink()
        began = time.time()
        with pytest.raises(LaunchTimeout) as info:
            launch(work, run_dir, world_size=world_size, timeout=timeout)
        seconds = time.time() - began
        there = [Path(run_dir) / marker.format(rank=r) for r in range(world_size)]
        if all(p.exists() and p.stat().st_mtime - began < timeout / 2 for p in there):
            return info.value, timeout, seconds
    pytest.fail(f"the ranks were not where they hang within half of a {timeout} s timeout")


def test_timeout_shows_where_each_rank_was_stuck_and_kills_everything(tmp_path):
    def work(run_dir):
        rank, _ = _init()
        _there(run_dir)
        if rank == 0:
            time.sleep(600)  # never arrives at the barrier
        dist.barrier()

    timed_out, timeout, elapsed = _timed_out(work, str(tmp_path))
    assert timeout <= elapsed < timeout + 60  # the timeout, then the stacks and the teardown
    stacks = timed_out.stacks
    assert set(stacks) == {0, 1}
    assert "in work" in stacks[0] and "time.sleep(600)  # never arrives" in stacks[0], "frames show their source"
    assert "in barrier" in stacks[1] and "dist.barrier()" in stacks[1]
    assert "in _bootstrap" not in stacks[0] and "pytest" not in stacks[0], "the launcher's own frames are trimmed"
    assert "time.sleep(600)  # never arrives" in str(timed_out)


def test_grandchildren_of_a_hung_worker_are_stopped_too(tmp_path):
    def work(run_dir):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print("grandchild", child.pid, flush=True)
        _there(run_dir)
        time.sleep(600)

    _timed_out(work, str(tmp_path))
    # conftest's fixture asserts that no descendant of this process survives


def test_interrupting_the_cell_stops_every_worker_and_the_next_launch_works(tmp_path):
    def hang(run_dir):
        _there(run_dir)
        time.sleep(600)

    start = time.monotonic()
    with cell_interrupted_when(lambda: all((tmp_path / f"there.{r}").exists() for r in range(2)), 120), \
            pytest.raises(KeyboardInterrupt):
        launch(hang, str(tmp_path), world_size=2, timeout=300)
    assert time.monotonic() - start < 150  # under half the timeout: the interrupt ended it
    assert not [p for p in psutil_children() if p.pid != _server_pid()]
    assert launch(lambda: os.environ["RANK"], world_size=2, timeout=60) == ["0", "1"]


def psutil_children():
    import psutil

    return psutil.Process().children(recursive=True)


def _server_pid():
    server = server_module.current_server()
    return server.pid if server is not None else None


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
    with pytest.raises(ValueError, match="start_method='fork' would fork this kernel"):
        launch(print, world_size=2, start_method="fork")
    with pytest.raises(ValueError, match="start_method must be one of"):
        launch(print, world_size=2, start_method="threads")
    with pytest.raises(ValueError, match="threads must be a positive int"):
        launch(print, world_size=2, threads=0)
    with pytest.raises(ValueError, match="rendezvous must be"):
        launch(print, world_size=2, rendezvous="udp")
    assert not [p for p in psutil_children() if p.pid != _server_pid()]


def test_an_unpicklable_return_value_names_the_rank():
    def work():
        if os.environ["RANK"] == "1":
            return threading.Lock()
        return 1

    with pytest.raises(WorkerError, match=r"rank 1 returned a value that cannot be pickled \(lock\)"):
        launch(work, world_size=2, timeout=60)


def test_the_kernel_is_never_forked(monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    assert launch_module.choose_start_method(None) == "forkserver"
    monkeypatch.setattr(sys, "platform", "darwin")
    assert launch_module.choose_start_method(None) == "spawn"
    with pytest.raises(ValueError, match="the fork-server needs Linux"):
        launch_module.choose_start_method("forkserver")
    with pytest.raises(ValueError, match="unsafe"):
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
        # rank 0 hosts the store: leaving before rank 1 has finished joining through it would end rank 1's join
        # ("Failed to recv"), as it did on a busy machine; after a barrier both have joined
        dist.barrier()
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
         "    print('pid', os.getpid(), os.getppid(), flush=True)\n"
         "    time.sleep(600)\n"
         "helpers.launch(hang, world_size=2, timeout=600)\n"],
        stdout=subprocess.PIPE, text=True)
    pids = []
    while len(pids) < 3:
        line = kernel.stdout.readline()
        assert line, "the stand-in kernel ended before its workers started"
        if " pid " in line:
            worker, server = map(int, line.split()[-2:])
            pids += [worker] + ([server] if server not in pids else [])
    kernel.kill()
    kernel.wait()
    kernel.stdout.close()
    deadline = time.monotonic() + 120  # they die with the kernel, within a second here: a deadline, not a wait
    while time.monotonic() < deadline and any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                                              for p in pids):
        time.sleep(0.1)
    survivors = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert not survivors, f"workers or their fork-server {survivors} outlived the kernel"


def test_workers_run_autograd_with_threads_after_the_kernel_ran_multithreaded_autograd():
    """The GPU failure's cause, on CPU: a process that has run autograd and OpenMP holds threads and must not be
    forked. Workers come from the server, so they run a 2-thread backward pass and their parent is the server."""
    torch.set_num_threads(2)
    weight = torch.randn(600, 600, requires_grad=True)
    (weight @ weight).tanh().sum().backward()  # autograd's engine and an OpenMP pool now run in this process

    def work(seed):
        torch.manual_seed(seed)
        w = torch.randn(300, 300, requires_grad=True)
        (w @ w).tanh().sum().backward()
        return w.grad, torch.get_num_threads(), os.getppid()

    results = launch(work, 7, world_size=2, threads=2, timeout=120)
    torch.manual_seed(7)
    w = torch.randn(300, 300, requires_grad=True)
    (w @ w).tanh().sum().backward()
    for grad, threads, parent in results:
        torch.testing.assert_close(grad, w.grad)
        assert threads == 2
        assert parent == _server_pid() != os.getpid()


def test_the_server_holds_one_thread_and_imported_torch_without_running_it():
    launch(lambda: None, world_size=1, timeout=60)
    pid = _server_pid()
    assert len(os.listdir(f"/proc/{pid}/task")) == 1, "a fork of a process with threads is unsafe"
    maps = open(f"/proc/{pid}/maps").read()
    assert "libtorch" in maps, "the server has torch loaded, so a worker does not import it again"


def test_a_worker_sees_the_kernel_as_it_is_at_launch_time(tmp_path, monkeypatch):
    launch(lambda: None, world_size=1, timeout=60)  # the server starts before the changes below
    server = _server_pid()
    module = tmp_path / "beside_the_notebook.py"
    module.write_text("def triple(x):\n    return 3 * x\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("NCCL_DEBUG", "INFO")

    def work():
        import beside_the_notebook

        return os.getcwd(), os.environ.get("NCCL_DEBUG"), beside_the_notebook.triple(int(os.environ["RANK"]))

    assert launch(work, world_size=2, timeout=60) == [(str(tmp_path), "INFO", 0), (str(tmp_path), "INFO", 3)]
    assert _server_pid() == server, "a variable read at init_process_group needs no new server"


def test_a_variable_torch_reads_at_import_restarts_the_server(monkeypatch):
    launch(lambda: None, world_size=1, timeout=60)
    before = _server_pid()
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "INFO")
    assert launch(lambda: os.environ["TORCH_CPP_LOG_LEVEL"], world_size=1, timeout=60) == ["INFO"]
    assert _server_pid() != before
    import psutil

    assert not psutil.pid_exists(before) or psutil.Process(before).status() == psutil.STATUS_ZOMBIE


def test_a_server_whose_installation_changed_is_replaced(monkeypatch):
    launch(lambda: None, world_size=1, timeout=60)
    before = _server_pid()
    real = server_module.installation_fingerprint
    monkeypatch.setattr(server_module, "installation_fingerprint", lambda: {**real(), "torch": "reinstalled"})
    assert launch(lambda: os.getppid(), world_size=1, timeout=60) == [_server_pid()]
    assert _server_pid() != before


def test_a_dead_server_is_replaced():
    launch(lambda: None, world_size=1, timeout=60)
    before = server_module.current_server()
    os.kill(before.pid, signal.SIGKILL)
    before.process.wait()
    assert launch(lambda: int(os.environ["RANK"]), world_size=2, timeout=60) == [0, 1]
    assert _server_pid() != before.pid


def test_random_state_is_a_fresh_processs_not_a_copied_one():
    def work():
        import random

        import numpy as np

        return random.random(), float(np.random.rand()), torch.initial_seed()

    first, second = launch(work, world_size=2, timeout=60), launch(work, world_size=2, timeout=60)
    draws = first + second
    for generator in range(3):
        values = [d[generator] for d in draws]
        assert len(set(values)) == 4, f"generator {generator} repeats across ranks or launches: {values}"


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_threads_split_the_cores_unless_the_user_says_otherwise(start_method, monkeypatch):
    def work():
        return torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]

    cores = devices.usable_cores()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    expected = max(1, cores // 2)
    assert launch(work, world_size=2, start_method=start_method, timeout=300) == [(expected, str(expected))] * 2
    assert launch(work, world_size=1, start_method=start_method, timeout=300) == [(cores, str(cores))]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert launch(work, world_size=1, start_method=start_method, timeout=300) == [(1, "1")]
    assert launch(work, world_size=1, start_method=start_method, threads=3, timeout=300) == [(3, "3")]


def test_the_supervisor_wakes_on_events_not_on_a_timer(monkeypatch):
    """A silent rank that works 3 s costs the kernel a handful of wake-ups (a 50 ms timer would be 60)."""
    wakeups = []
    real_select = __import__("selectors").DefaultSelector.select

    def counting_select(self, timeout=None):
        wakeups.append(timeout)
        return real_select(self, timeout)

    monkeypatch.setattr(__import__("selectors").DefaultSelector, "select", counting_select)

    def work():
        time.sleep(3)
        return "done"

    assert launch(work, world_size=2, timeout=60) == ["done", "done"]
    assert len(wakeups) < 20, wakeups


def test_a_failed_rank_and_its_hung_peer_are_both_in_the_error():
    def work():
        rank, _ = _init()
        if rank == 0:
            raise ValueError("rank 0 gave up")
        time.sleep(600)  # rank 1 waits on something that will never come

    with pytest.raises(WorkerError) as info:
        launch(work, world_size=2, timeout=60, failure_grace=1.0)
    err = info.value
    assert (err.rank, err.kind) == (0, "ValueError")
    assert set(err.stacks) == {1} and "time.sleep(600)  # rank 1 waits" in err.stacks[1]
    assert "where rank 1 was" in str(err)


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
    assert time.monotonic() - start < 30  # under half the timeout: EXIT_GRACE_S ended the hang
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
    assert time.monotonic() - start < 30  # under half the timeout
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


@pytest.mark.timeout(1200)
def test_a_cells_class_can_be_pickled_by_name_in_the_workers():
    """torch.distributed.rpc pickles a cell's class as `__main__.Name`: the worker's __main__ must have it."""
    import subprocess

    kernel = subprocess.run(
        [sys.executable, "-c",
         "import pickle, helpers\n"
         "class Counter:\n"
         "    pass\n"
         "def work():\n"
         "    return len(pickle.dumps(Counter())) > 0 and pickle.loads(pickle.dumps(Counter)) is Counter\n"
         "print(helpers.launch(work, world_size=2, timeout=120))\n"],
        capture_output=True, text=True, timeout=900)  # a fresh interpreter and fork-server: up to 65 s here, loaded
    assert kernel.stdout.strip().splitlines()[-1] == "[True, True]", kernel.stdout + kernel.stderr


# ------------------------------------------------------------------ nothing a rank started outlives the launch
def _starts_descendants(pid_dir: str):
    """A worker body's first lines: a plain subprocess, one in a session of its own, and an orphan (its parent
    exits at once, so it is re-parented); their pids go to `pid_dir`."""
    import subprocess
    import sys

    plain = subprocess.Popen(["sleep", "300"])
    detached = subprocess.Popen(["sleep", "301"], start_new_session=True)
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess; print(subprocess.Popen(['sleep', '302'], "
                               "start_new_session=True, stdout=subprocess.DEVNULL).pid)"],
                              stdout=subprocess.PIPE, text=True)
    orphan = int(parent.communicate()[0])
    with open(os.path.join(pid_dir, f"pids.{os.environ['RANK']}.tmp"), "w") as f:
        f.write(f"{plain.pid} {detached.pid} {orphan}")
    os.replace(os.path.join(pid_dir, f"pids.{os.environ['RANK']}.tmp"),
               os.path.join(pid_dir, f"pids.{os.environ['RANK']}"))


def _assert_every_descendant_ended(pid_dir, world_size: int = 2) -> None:
    import psutil

    pids = [int(p) for rank in range(world_size) for p in (pid_dir / f"pids.{rank}").read_text().split()]
    assert len(pids) == 3 * world_size, "every rank started its three processes"
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
             and "sleep" in psutil.Process(p).name()]
    assert not alive, f"a rank's subprocesses outlived it: {alive}"
    assert not server_module.processes_left()


def test_what_a_rank_started_ends_with_it_after_success(tmp_path):
    def work(pid_dir):
        _starts_descendants(pid_dir)
        return "done"

    assert launch(work, str(tmp_path), world_size=2, timeout=120) == ["done", "done"]
    _assert_every_descendant_ended(tmp_path)


def test_what_a_rank_started_ends_with_it_after_a_failure(tmp_path):
    def work(pid_dir):
        _starts_descendants(pid_dir)
        raise ValueError("failed after starting subprocesses")

    with pytest.raises(WorkerError, match="failed after starting subprocesses"):
        launch(work, str(tmp_path), world_size=2, timeout=120)
    _assert_every_descendant_ended(tmp_path)


def test_what_a_rank_started_ends_with_it_after_a_timeout(tmp_path):
    def work(pid_dir):
        _starts_descendants(pid_dir)
        time.sleep(600)

    _timed_out(work, str(tmp_path), marker="pids.{rank}")
    _assert_every_descendant_ended(tmp_path)


def test_what_a_rank_started_ends_with_it_after_an_interrupt(tmp_path):
    def work(pid_dir):
        _starts_descendants(pid_dir)
        time.sleep(600)

    with cell_interrupted_when(lambda: all((tmp_path / f"pids.{r}").exists() for r in range(2)), 120), \
            pytest.raises(KeyboardInterrupt):
        launch(work, str(tmp_path), world_size=2, timeout=300)
    _assert_every_descendant_ended(tmp_path)


def test_the_leak_check_finds_a_launched_process_that_escaped_every_tree():
    """A process re-parented to init is out of the kernel's tree; its environment still says who launched it."""
    from helpers.launcher.sessions import LAUNCHED_BY_VAR

    quiet = "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL"  # no pipe of ours held open by it
    parent = subprocess.run(
        [sys.executable, "-c", f"import subprocess; print(subprocess.Popen(['sleep', '303'], "
         f"start_new_session=True, {quiet}).pid)"], env={**os.environ, LAUNCHED_BY_VAR: str(os.getpid())},
        capture_output=True, text=True, timeout=60)
    escaped = int(parent.stdout)
    try:
        assert escaped in [p.pid for p in server_module.processes_left()]
    finally:
        os.kill(escaped, signal.SIGKILL)
