"""Run one function on N real worker processes and bring every rank's return value back to the kernel.

Why not `torch.multiprocessing.spawn` or torchrun's elastic agent from a notebook: spawn needs an importable
function and seconds of start-up; the elastic agent's `ChildFailedError` reports whichever rank it noticed first,
which is often a peer's "connection closed" rather than the rank that raised. Here:

- workers see torchrun's environment, so the function calls `dist.init_process_group()` itself and runs unchanged
  under torchrun;
- fork when it is safe (Linux, no CUDA context in the kernel), else spawn with the function shipped by cloudpickle;
- every rank's output appears live, prefixed with its rank;
- the root cause is reported: the rank, its exception type, message and traceback, peers' secondary errors apart;
- a hang ends at `timeout` with each live rank's Python stack; nothing is left running, whatever happened;
- a rank that reported its result and then hangs on its way out (freeing torch objects) cannot lose the
  result: it is stopped after `EXIT_GRACE_S` with an `ExitHangWarning` that shows where it was.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from dataclasses import dataclass

from helpers import devices
from helpers.launcher.worker import STACK_SIGNAL, run_worker
from helpers.launcher.rendezvous import loopback_environment
from helpers.launcher.progress import RUN_DIR_VAR, ProgressDisplay, read_progress

DEFAULT_TIMEOUT = 300.0
# Seconds a rank that has written its result (or error) gets to exit. Past that it is stuck freeing what its
# function made (see `_worker`): it is stopped, its result kept, and an ExitHangWarning shows where it was.
EXIT_GRACE_S = 10.0
STDERR_TAIL_LINES = 40  # of a rank that died without a Python exception, in its WorkerError
# Messages a rank raises because a *peer* went away: reported, but never as the root cause.
SECONDARY = re.compile(
    r"connection closed by peer|connection reset|broken pipe|econnreset|recvbytes|sendbytes|"
    r"nccl communicator was aborted|connectfullmesh failed|socket closed|peer.*(closed|disconnected)|"
    r"failed to recv|read error|timed out waiting for", re.IGNORECASE)


@dataclass
class RankFailure:
    rank: int
    kind: str  # exception type name, or "exit"
    message: str
    traceback: str = ""
    time: float = 0.0
    exception: BaseException | None = None

    @property
    def secondary(self) -> bool:
        return bool(SECONDARY.search(self.message))

    def headline(self) -> str:
        return f"rank {self.rank} {'raised ' + self.kind if self.kind != 'exit' else 'died'}: {self.message}"


class ExitHangWarning(UserWarning):
    """A rank reported its result (or error) but did not exit: it was stopped, and what it reported kept."""


class WorkerError(RuntimeError):
    """A rank failed. `rank`, `kind`, `message` and `traceback` describe the root cause; `failures` all of them;
    `results` the return values of the ranks that finished (a parameter server's record when a trainer died)."""

    def __init__(self, root: RankFailure, failures: list[RankFailure], results: dict | None = None):
        self.rank, self.kind, self.message = root.rank, root.kind, root.message
        self.results = dict(results or {})  # return values of the ranks that did return, by rank
        self.returned = sorted(self.results)
        self.traceback, self.failures, self.original = root.traceback, failures, root.exception
        others = [f for f in failures if f is not root]
        text = root.headline()
        if root.traceback:
            text += f"\n\n--- traceback of rank {root.rank} ---\n{root.traceback.rstrip()}"
        if others:
            text += "\n\nother ranks:\n" + "\n".join(
                f"  {'(secondary) ' if f.secondary else ''}{f.headline().splitlines()[0][:300]}" for f in others)
        if root.secondary and self.returned:
            text += (f"\n\nranks {self.returned} had already returned: a rank that leaves while its peers still "
                     "wait in a collective is the usual cause of this error.")
        super().__init__(text)


class LaunchTimeout(TimeoutError):
    """The launch outlived its timeout. `stacks` maps each rank that was still running to its Python stack."""

    def __init__(self, timeout: float, stacks: dict[int, str], finished: list[int]):
        self.timeout, self.stacks, self.finished = timeout, stacks, finished
        text = f"launch timed out after {timeout:g} s; ranks still running: {sorted(stacks)}"
        if finished:
            text += f"; ranks that had returned: {finished}"
        for rank, stack in sorted(stacks.items()):
            text += f"\n\n--- where rank {rank} was stuck ---\n{stack.rstrip() or '(no stack could be taken)'}"
        super().__init__(text)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago, chosen in the parent as torchrun's --standalone does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def choose_start_method(start_method: str | None) -> str:
    """fork where safe, spawn elsewhere; named explicitly because Python 3.14 changed the default."""
    if start_method is None:
        if sys.platform.startswith("linux") and not devices.cuda_initialized():
            return "fork"
        return "spawn"
    if start_method not in ("fork", "spawn"):
        raise ValueError(f"start_method must be 'fork' or 'spawn', not {start_method!r}")
    if start_method == "fork" and devices.cuda_initialized():
        raise ValueError("this kernel has initialised CUDA, so a forked worker could not use it; "
                         "use start_method='spawn' (or restart the kernel and keep CUDA out of it)")
    return start_method


def _validate(fn, world_size: int, backend: str | None, timeout: float) -> None:
    if not callable(fn):
        raise TypeError(f"launch needs a callable to run on every rank, got {type(fn).__name__}: {fn!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if backend not in (None, "gloo", "nccl", "mpi"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or 'mpi', not {backend!r}")
    if backend == "nccl":
        gpus = devices.gpu_count()
        if world_size > gpus:
            raise ValueError(f"{world_size} NCCL ranks need {world_size} GPUs, this machine has {gpus}: NCCL "
                             "gives each rank a GPU of its own and refuses two ranks on one GPU. "
                             "Use backend='gloo' or a smaller world_size.")


def default_world_size() -> int:
    """One process per GPU when there are at least two, else two CPU processes."""
    gpus = devices.gpu_count()
    return gpus if gpus >= 2 else 2


class _OutputTail:
    """Follows one rank's stdout or stderr file and hands back complete lines, prefixed with the rank."""

    def __init__(self, path: str, rank: int, stream):
        self.path, self.prefix, self.stream = path, f"[rank {rank}] ", stream
        self.offset, self.partial = 0, b""

    def pump(self, final: bool = False) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        self.offset += len(chunk)
        data = self.partial + chunk
        lines = data.split(b"\n")
        self.partial = lines.pop()
        if final and self.partial:
            lines.append(self.partial)
            self.partial = b""
        if lines:
            text = "".join(self.prefix + line.decode("utf-8", "backslashreplace").split("\r")[-1] + "\n"
                           for line in lines)
            self.stream.write(text)
            self.stream.flush()


class _SpawnedWorker:
    """A worker started as a fresh interpreter (subprocess), with the few methods of mp.Process we use.

    Why not multiprocessing's spawn: it re-imports the parent's __main__ in every child, which breaks scripts
    without a __main__ guard and costs a kernel its start-up; the payload here travels in a file instead.
    """

    def __init__(self, run_dir: str, rank: int):
        from helpers.paths import REPO_ROOT

        helpers_root = str(REPO_ROOT)
        code = (f"import sys; sys.path.insert(0, {helpers_root!r}); from helpers.launcher.worker import spawn_main; "
                f"spawn_main({run_dir!r}, {rank})")
        self._popen = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ),
                                       start_new_session=True, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.pid = self._popen.pid

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    @property
    def exitcode(self):
        return self._popen.poll()

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


def _read_record(path: str):
    with open(path, "rb") as f:
        return pickle.loads(f.read())


def _exit_failure(rank: int, exitcode: int | None, run_dir: str) -> RankFailure:
    """A rank that ended without a result or an exception. Its last stderr lines stand in for the traceback
    (a C++ abort message, faulthandler's dump of a fatal signal), shown even when the launch was quiet."""
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name if -exitcode in signal.Signals._value2member_map_ else -exitcode
        message = f"killed by signal {name} before returning (no Python exception)"
    else:
        message = f"exited with code {exitcode} before returning (no Python exception: os._exit or a crash)"
    tail = _last_lines(os.path.join(run_dir, f"err.{rank}"), STDERR_TAIL_LINES)
    traceback = f"(its last {STDERR_TAIL_LINES} lines of stderr at most)\n{tail}" if tail.strip() else ""
    return RankFailure(rank, "exit", message, traceback, time=time.time())


def _last_lines(path: str, count: int, max_bytes: int = 64 << 10) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - max_bytes))
            data = f.read()
    except OSError:
        return ""
    # faulthandler's dump of a fatal signal lists a forked worker's inherited kernel frames and every extension
    # module: neither says anything about the crash, and both would push its message out of the tail
    text = _trim_stack(data.decode("utf-8", "backslashreplace"))
    return "\n".join([line for line in text.splitlines() if not line.startswith("Extension modules:")][-count:])


def _collect(rank: int, proc, run_dir: str, results: dict, failures: dict) -> None:
    """Record what an exited rank left behind: a result, an exception, or only its exit code."""
    result_path, error_path = os.path.join(run_dir, f"result.{rank}"), os.path.join(run_dir, f"error.{rank}")
    if os.path.exists(result_path):
        try:
            results[rank] = _read_record(result_path)
        except Exception as exc:  # noqa: BLE001
            failures[rank] = RankFailure(rank, "TypeError", f"the return value of rank {rank} could not be "
                                         f"unpickled in the kernel: {type(exc).__name__}: {exc}", time=time.time())
    elif os.path.exists(error_path):
        rec = _read_record(error_path)
        original = None
        if rec.get("exception"):
            try:
                original = pickle.loads(rec["exception"])
            except Exception:  # noqa: BLE001
                original = None
        failures[rank] = RankFailure(rank, rec["type"], rec["message"], rec["traceback"], rec["time"], original)
    else:
        failures[rank] = _exit_failure(rank, proc.exitcode, run_dir)


def _outcome(run_dir: str, rank: int) -> str | None:
    """'result' or 'error' once the rank has written it (atomically: its existence means it is complete)."""
    for kind in ("result", "error"):
        if os.path.exists(os.path.join(run_dir, f"{kind}.{rank}")):
            return kind
    return None


def _stop_after_outcome(rank: int, proc, run_dir: str, results: dict, failures: dict) -> None:
    """A rank reported, then hung on its way out: keep what it reported, stop it, show where it hung."""
    stack = _take_stacks({rank: proc}, run_dir).get(rank, "")
    _stop([proc])
    _collect(rank, proc, run_dir, results, failures)
    warnings.warn(
        f"rank {rank} reported its {_outcome(run_dir, rank)} but had not exited {EXIT_GRACE_S:g} s later; it was "
        "stopped and what it reported kept. A finished rank hangs like this while freeing what its function made, "
        "typically torch waiting, with the GIL held, on a background thread (gloo's, after destroy_process_group) "
        f"that needs the GIL. Where it was:\n{stack.rstrip() or '(no stack could be taken)'}",
        ExitHangWarning, stacklevel=4)


def root_cause(failures: list[RankFailure]) -> RankFailure:
    """The earliest failure that is not a reaction to a peer's; the earliest of all if every one is."""
    primary = [f for f in failures if not f.secondary] or failures
    return min(primary, key=lambda f: (f.time, f.rank))


def _process_tree(pid: int) -> list:
    try:
        import psutil

        return psutil.Process(pid).children(recursive=True)
    except Exception:  # noqa: BLE001 - psutil missing or process gone
        return []


def _stop(procs: list, grace: float = 1.0) -> None:
    """Stop every worker and everything it started, then reap them: no orphan, no zombie."""
    descendants = [d for p in procs if p.pid for d in _process_tree(p.pid)]
    for sig in (signal.SIGTERM, getattr(signal, "SIGKILL", signal.SIGTERM)):
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            try:
                os.killpg(p.pid, sig)  # the worker's session: it and everything it started
            except (ProcessLookupError, PermissionError, AttributeError):
                try:  # not yet a session leader (stopped during start-up), or no killpg on this platform
                    os.kill(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        for d in descendants:
            try:
                d.send_signal(sig)
            except Exception:  # noqa: BLE001
                pass
        deadline = time.monotonic() + grace
        for p in alive:
            p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.pid is not None:
            p.join(5)
    try:
        import psutil

        psutil.wait_procs(descendants, timeout=2)
    except Exception:  # noqa: BLE001
        pass


def _take_stacks(procs: dict, run_dir: str, wait: float = 2.0) -> dict[int, str]:
    """The Python stack of every rank in `procs` (rank -> process) that is still running."""
    live = {rank: p for rank, p in procs.items() if p.is_alive()}
    if STACK_SIGNAL is None:
        return {rank: "" for rank in live}
    for p in live.values():
        try:
            os.kill(p.pid, STACK_SIGNAL)
        except ProcessLookupError:
            pass
    stacks: dict[int, str] = {}
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        for rank in live:
            try:
                with open(os.path.join(run_dir, f"stack.{rank}")) as f:
                    stacks[rank] = f.read()
            except OSError:
                stacks[rank] = ""
        if all(s.strip() for s in stacks.values()):
            time.sleep(0.1)  # let the last lines land
            for rank in live:
                with open(os.path.join(run_dir, f"stack.{rank}")) as f:
                    stacks[rank] = f.read()
            break
        time.sleep(0.05)
    return {rank: _trim_stack(stack) for rank, stack in stacks.items()}


def _trim_stack(stack: str) -> str:
    """Drop the frames below the worker's entry point: a forked worker inherits the kernel's frames."""
    out, skip = [], False
    for line in stack.splitlines():
        if line.startswith(("Thread ", "Current thread ")):
            skip = False
        if skip:
            continue
        if line.strip().endswith(" in run_worker"):  # kept: a rank can hang in the launcher's code, not fn's
            out.append(line)
            skip = True
            continue
        out.append(line)
    return "\n".join(out)


def launch(fn, *args, world_size: int | None = None, timeout: float = DEFAULT_TIMEOUT, backend: str | None = None,
           start_method: str | None = None, rendezvous: str = "file", env: dict | None = None,
           failure_grace: float = 3.0, quiet: bool = False, threads: int | None = None, **kwargs) -> list:
    """Run `fn(*args, **kwargs)` on `world_size` processes on this host; return their results ordered by rank.

    backend: what `helpers.default_backend()` answers in the workers (None: NCCL when every rank can have a GPU
        of its own, else gloo). 'nccl' with more ranks than GPUs is refused before anything starts.
    rendezvous: 'file' answers env:// with a FileStore and keeps every socket on loopback (see
        `loopback_rendezvous`); 'tcp' leaves PyTorch's TCPStore (listening on all interfaces) as torchrun does.
    env: extra environment variables for the workers only (the kernel's environment is never changed).
    failure_grace: seconds the peers of a failed rank get to fail on their own before they are killed.
    quiet: hide the workers' output.
    threads: torch intra-op threads per worker. Default: 1 for forked workers, as torchrun's default
        OMP_NUM_THREADS=1; cores // world_size for spawned ones. Why 1 after fork: once this kernel has run a
        multi-threaded torch op, GNU OpenMP's thread pool cannot survive a fork, and a forked worker that asks
        for two or more threads hangs at its first parallel op. Pass threads=N with start_method='spawn' for
        CPU-bound single-rank measurements that need every core.
    Raises WorkerError (root cause first), LaunchTimeout (with each stuck rank's stack), or KeyboardInterrupt
    (after stopping every worker) if the cell is interrupted.
    """
    world_size = default_world_size() if world_size is None else world_size
    _validate(fn, world_size, backend, timeout)
    if rendezvous not in ("file", "tcp"):
        raise ValueError(f"rendezvous must be 'file' or 'tcp', not {rendezvous!r}")
    method = choose_start_method(start_method)
    backend = backend or devices.default_backend(world_size)
    if threads is None:
        threads = 1 if method == "fork" else max(1, devices.usable_cores() // world_size)
    elif not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive int, got {threads!r}")
    worker_env = {
        "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(world_size), "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": uuid.uuid4().hex[:12], "OMP_NUM_THREADS": str(threads),
        "COOKBOOK_BACKEND": backend,
    }
    worker_env.update({k: v for k, v in loopback_environment().items() if k not in os.environ})
    worker_env.update({k: str(v) for k, v in (env or {}).items()})

    out_stream = open(os.devnull, "w") if quiet else sys.stdout
    err_stream = open(os.devnull, "w") if quiet else sys.stderr

    with tempfile.TemporaryDirectory(prefix="cookbook-launch-") as run_dir:
        worker_env[RUN_DIR_VAR] = run_dir
        spec = {"run_dir": run_dir, "env": worker_env, "loopback_store": rendezvous == "file",
                "sys_path": list(sys.path), "parent_pid": os.getpid()}
        procs: list = []
        tails = [t for rank in range(world_size)
                 for t in (_OutputTail(os.path.join(run_dir, f"out.{rank}"), rank, out_stream),
                           _OutputTail(os.path.join(run_dir, f"err.{rank}"), rank, err_stream))]
        progress = ProgressDisplay(world_size)
        try:
            _start(procs, method, run_dir, spec, (fn, args, kwargs))
            return _supervise(procs, run_dir, tails, progress, timeout, failure_grace)
        finally:
            _stop(procs)
            for t in tails:
                t.pump(final=True)
            progress.update(read_progress(run_dir, world_size), force=True)
            if quiet:
                out_stream.close()
                err_stream.close()


def _start(procs: list, method: str, run_dir: str, spec: dict, payload: tuple) -> None:
    """Start the workers into `procs` (filled as they start, so a failure half-way still stops them all)."""
    world_size = int(spec["env"]["WORLD_SIZE"])
    if method == "fork":
        ctx = mp.get_context("fork")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
            for rank in range(world_size):
                p = ctx.Process(target=run_worker, args=(payload, rank, spec), name=f"cookbook-rank-{rank}")
                p.start()
                procs.append(p)
        return
    import cloudpickle

    with open(os.path.join(run_dir, "payload.pkl"), "wb") as f:
        cloudpickle.dump(payload, f)
    with open(os.path.join(run_dir, "spec.pkl"), "wb") as f:
        pickle.dump(spec, f)
    for rank in range(world_size):
        procs.append(_SpawnedWorker(run_dir, rank))


def _supervise(procs, run_dir, tails, progress, timeout, failure_grace) -> list:
    from multiprocessing.connection import wait as wait_any

    world_size = len(procs)
    results: dict[int, object] = {}
    failures: dict[int, RankFailure] = {}
    collected: set[int] = set()
    reported_at: dict[int, float] = {}  # ranks that wrote their result or error and are still running
    deadline = time.monotonic() + timeout
    first_failure_at = None
    while True:
        live = [p.sentinel for rank, p in enumerate(procs) if rank not in collected and hasattr(p, "sentinel")]
        if live:
            wait_any(live, timeout=0.05)
        else:
            time.sleep(0.02)
        for t in tails:
            t.pump()
        progress.update(read_progress(run_dir, world_size))
        for rank, p in enumerate(procs):
            if rank not in collected and not p.is_alive():
                p.join()
                _collect(rank, p, run_dir, results, failures)
                collected.add(rank)
            elif rank not in collected and _outcome(run_dir, rank):
                reported_at.setdefault(rank, time.monotonic())
                if time.monotonic() - reported_at[rank] > EXIT_GRACE_S:
                    _stop_after_outcome(rank, p, run_dir, results, failures)
                    collected.add(rank)
        if failures and first_failure_at is None:
            first_failure_at = time.monotonic()
        if len(collected) == world_size:
            break
        if first_failure_at is not None and time.monotonic() - first_failure_at > failure_grace:
            break
        if time.monotonic() > deadline:
            stacks = _take_stacks(dict(enumerate(procs)), run_dir)
            if failures:  # a rank failed, its peers hung: the failure is the story, the stacks its context
                break
            raise LaunchTimeout(timeout, stacks, sorted(results))
    if failures:
        ordered = sorted(failures.values(), key=lambda f: (f.time, f.rank))
        root = root_cause(ordered)
        raise WorkerError(root, [root] + [f for f in ordered if f is not root], results) from root.exception
    return [results[rank] for rank in range(world_size)]
