"""`launch`: run one function on N real worker processes and bring every rank's return value back to the kernel.

Why not `torch.multiprocessing.spawn` or torchrun's elastic agent from a notebook: spawn needs an importable
function and seconds of start-up per launch; the elastic agent's `ChildFailedError` reports whichever rank it
noticed first, often a peer's "connection closed". Why not fork the kernel, as accelerate's `notebook_launcher`
does: a kernel that has run autograd, OpenMP or CUDA holds threads, and a fork of it is unsafe (CUDA in the child
fails with "initialization error" although `torch.cuda.is_initialized()` says False). Here:

- workers come from the fork-server (`server`), a clean process with torch imported: safe and fast; the payload
  travels by value (cloudpickle), so functions and closures defined in cells work; `start_method="spawn"` starts
  fresh interpreters instead (the default on macOS and Windows);
- a worker sees the kernel's state at launch time (environment, current directory, sys.path), torchrun's
  environment (RANK, LOCAL_RANK, WORLD_SIZE, ...), a fresh process's random state, and
  `threads = cores // world_size` intra-op threads unless OMP_NUM_THREADS or `threads=` says otherwise (torchrun
  defaults to OMP_NUM_THREADS=1 to be safe with many ranks per node; a notebook's few ranks on a laptop would
  then leave cores idle, so the launcher splits the cores instead);
- every rank's output appears live, prefixed with its rank; long work shows per-rank progress bars;
- the root cause is reported (`errors`); a hang ends at `timeout` with each live rank's stack, source lines
  included; nothing is left running, whatever happened (`sessions`);
- a rank that reported its result and then hangs on its way out (freeing torch objects) cannot lose the
  result: it is stopped after `EXIT_GRACE_S` with an `ExitHangWarning` that shows where it was.
"""
from __future__ import annotations

import os
import socket
import sys
import tempfile
import uuid
from dataclasses import dataclass

from helpers import devices
from helpers.launcher import run_folder
from helpers.launcher.output import RankPanels, RankStream
from helpers.launcher.protocol import NoticeReader
from helpers.launcher.rendezvous import loopback_environment
from helpers.launcher.server import ServerWorker, server_for
from helpers.launcher.sessions import LAUNCHED_BY_VAR, stop_sessions
from helpers.launcher.spawn import SpawnedWorker
from helpers.launcher.supervise import RankProcess, RankSlot, Supervision

DEFAULT_TIMEOUT = 300.0
# Seconds a rank that has written its result (or error) gets to exit. Past that it is stuck freeing what its
# function made (see `rank`): it is stopped, its result kept, and an ExitHangWarning shows where it was.
EXIT_GRACE_S = 10.0
# Seconds the peers of a failed rank get to fail on their own (their own error, or their stack) before they are
# stopped.
FAILURE_GRACE_S = 3.0
START_METHODS = ("forkserver", "spawn")


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago, chosen in the parent as torchrun's --standalone does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def choose_start_method(start_method: str | None) -> str:
    """'forkserver' on Linux, 'spawn' elsewhere; named explicitly because the platforms' defaults differ."""
    if start_method is None:
        return "forkserver" if sys.platform.startswith("linux") else "spawn"
    if start_method == "fork":
        raise ValueError("start_method='fork' would fork this kernel, which is unsafe once it has started threads "
                         "(autograd, OpenMP, CUDA, Jupyter's own): CUDA then fails in the workers. Use the default "
                         "'forkserver' (as fast, and safe) or 'spawn'.")
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, not {start_method!r}")
    if start_method == "forkserver" and not sys.platform.startswith("linux"):
        raise ValueError("the fork-server needs Linux (SOCK_SEQPACKET, PR_SET_PDEATHSIG); use 'spawn'")
    return start_method


def default_world_size() -> int:
    """One process per GPU when there are at least two, else two CPU processes."""
    gpus = devices.gpu_count()
    return gpus if gpus >= 2 else 2


def default_threads(world_size: int, env: dict) -> int:
    """Intra-op threads per worker: OMP_NUM_THREADS if the user set it, else this machine's cores split evenly."""
    try:
        return max(1, int(env["OMP_NUM_THREADS"]))
    except (KeyError, ValueError):
        return max(1, devices.usable_cores() // world_size)


def require_callable(fn, caller: str = "launch") -> None:
    if not callable(fn):
        raise TypeError(f"{caller} needs a callable to run on every rank, got {type(fn).__name__}: {fn!r}")


def validate_options(world_size, backend, timeout, rendezvous, threads) -> None:
    """Refuse a launch's options before anything starts, each with what to pass instead."""
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if rendezvous not in ("file", "tcp"):
        raise ValueError(f"rendezvous must be 'file' or 'tcp', not {rendezvous!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive int, got {threads!r}")
    if backend not in (None, "gloo", "nccl", "mpi"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or 'mpi', not {backend!r}")
    if backend == "nccl":
        gpus = devices.gpu_count()
        if world_size > gpus:
            raise ValueError(f"{world_size} NCCL ranks need {world_size} GPUs, this machine has {gpus}: NCCL "
                             "gives each rank a GPU of its own and refuses two ranks on one GPU. "
                             "Use backend='gloo' or a smaller world_size.")


def torchrun_environment(world_size: int, backend: str, threads: int) -> dict[str, str]:
    """What torchrun would set for a single-node job (RANK and LOCAL_RANK are set per worker)."""
    return {
        "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(world_size), "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": uuid.uuid4().hex[:12], "OMP_NUM_THREADS": str(threads),
        "COOKBOOK_BACKEND": backend, LAUNCHED_BY_VAR: str(os.getpid()),
    }


def launch(fn, *args, world_size: int | None = None, timeout: float = DEFAULT_TIMEOUT, backend: str | None = None,
           start_method: str | None = None, rendezvous: str = "file", env: dict | None = None,
           failure_grace: float = FAILURE_GRACE_S, quiet: bool = False, threads: int | None = None, **kwargs) -> list:
    """Run `fn(*args, **kwargs)` on `world_size` processes on this host; return their results ordered by rank.

    backend: what `helpers.default_backend()` answers in the workers (None: NCCL when every rank can have a GPU
        of its own, else gloo). 'nccl' with more ranks than GPUs is refused before anything starts.
    start_method: 'forkserver' (default on Linux) or 'spawn' (fresh interpreters; default elsewhere).
    rendezvous: 'file' answers env:// with a FileStore and keeps every socket on loopback (see `rendezvous`);
        'tcp' leaves PyTorch's TCPStore (listening on all interfaces) as torchrun does.
    env: extra environment variables for the workers only (the kernel's environment is never changed).
    failure_grace: seconds the peers of a failed rank get to fail on their own before they are stopped.
    quiet: hide the workers' output (a rank that dies without an exception still brings its last stderr lines).
    threads: torch intra-op threads per worker (default: OMP_NUM_THREADS if set, else cores // world_size).
    Raises WorkerError (root cause first), LaunchTimeout (with each stuck rank's stack), or KeyboardInterrupt
    (after stopping every worker) if the cell is interrupted.
    """
    require_callable(fn)
    launch_plan = LaunchPlan.make(world_size, backend=backend, start_method=start_method, env=env, threads=threads,
                                  timeout=timeout, rendezvous=rendezvous, failure_grace=failure_grace)
    out_stream = open(os.devnull, "w") if quiet else sys.stdout
    err_stream = open(os.devnull, "w") if quiet else sys.stderr
    try:
        with tempfile.TemporaryDirectory(prefix="cookbook-launch-") as run_dir:
            supervision = launch_plan.start(run_dir, fn, args, kwargs, out_stream, err_stream)
            try:
                return supervision.watch(launch_plan.timeout).values()
            finally:
                supervision.finish()
    finally:
        if quiet:
            out_stream.close()
            err_stream.close()


@dataclass
class LaunchPlan:
    """A start of ranks, decided before anything starts: what `launch` and `Workers` both begin from.

    `make` validates the options and fixes the environments (the kernel's as of now, torchrun's, a fresh port and
    run id); `start` writes the launch into its run folder, starts the ranks and hands back their `Supervision`.
    """
    world_size: int
    method: str  # 'forkserver' or 'spawn'
    user_env: dict  # the kernel's environment with the launch's extras: what a fork-server must match
    worker_env: dict  # what every rank's environment is (RANK and LOCAL_RANK aside)
    threads: int
    rendezvous: str
    timeout: float
    failure_grace: float
    exit_grace: float

    @classmethod
    def make(cls, world_size: int | None = None, *, backend: str | None = None, start_method: str | None = None,
             env: dict | None = None, threads: int | None = None, timeout: float = DEFAULT_TIMEOUT,
             rendezvous: str = "file", failure_grace: float = FAILURE_GRACE_S) -> "LaunchPlan":
        """The options as `launch` documents them, validated (ValueError or TypeError before anything starts)."""
        world_size = default_world_size() if world_size is None else world_size
        validate_options(world_size, backend, timeout, rendezvous, threads)
        method, user_env, worker_env, threads = plan(world_size, backend, start_method, env, threads)
        return cls(world_size, method, user_env, worker_env, threads, rendezvous, timeout, failure_grace,
                   EXIT_GRACE_S)

    def start(self, run_dir: str, fn, args: tuple, kwargs: dict, out_stream, err_stream,
              command_fds: dict[int, int] | None = None) -> Supervision:
        """Write `fn(*args, **kwargs)` and the kernel's state into `run_dir`, start the ranks, return their
        supervision; if the start fails, whatever started is stopped and the error raised.

        command_fds: rank -> the read end of its command pipe (persistent ranks, which take no `fn`: they serve the
        calls the pipe brings); handed over, then closed here."""
        worker_env = {**self.worker_env, run_folder.RUN_DIR_VAR: run_dir}
        run_folder.write_launch(run_dir, fn, args, kwargs, worker_env, self.threads,
                                loopback_store=self.rendezvous == "file")
        supervision = Supervision(run_dir, [], self.failure_grace, self.exit_grace)
        try:
            _start(supervision, self.method, self.world_size, self.user_env, worker_env, out_stream, err_stream,
                   command_fds)
        except BaseException:
            supervision.finish()
            raise
        return supervision


def plan(world_size: int, backend: str | None, start_method: str | None, env: dict | None,
         threads: int | None) -> tuple[str, dict, dict, int]:
    """(start method, the kernel's environment with the launch's extras, the workers' environment, threads)."""
    method = choose_start_method(start_method)
    backend = backend or devices.default_backend(world_size)
    user_env = {**os.environ, **{k: str(v) for k, v in (env or {}).items()}}
    threads = threads or default_threads(world_size, user_env)
    worker_env = {**user_env, **loopback_environment(), **torchrun_environment(world_size, backend, threads)}
    worker_env.update({k: str(v) for k, v in (env or {}).items() if k != "OMP_NUM_THREADS"})
    return method, user_env, worker_env, threads


def _start(supervision: Supervision, method: str, world_size: int, user_env: dict, worker_env: dict,
           out_stream, err_stream, command_fds: dict[int, int] | None = None) -> None:
    """Start the workers into `supervision.slots`; a failure half-way stops those already started.

    command_fds: rank -> the read end of its command pipe (persistent workers); handed over, then closed here."""
    pipes = {rank: [os.pipe() for _ in range(3)] for rank in range(world_size)}  # stdout, stderr, progress
    theirs = {rank: [w for _, w in p] + ([command_fds[rank]] if command_fds else []) for rank, p in pipes.items()}
    workers: dict[int, RankProcess] = {}
    try:
        if method == "forkserver":
            server = server_for(user_env)
            workers = {rank: ServerWorker(server, pid) for rank, pid in
                       server.fork(supervision.run_dir, theirs).items()}
        else:
            for rank in range(world_size):
                workers[rank] = SpawnedWorker(supervision.run_dir, rank, theirs[rank], worker_env, os.getcwd())
    except BaseException:
        stop_sessions([w.pid for w in workers.values()], lambda pid, t: next(
            w for w in workers.values() if w.pid == pid).wait_gone(t))
        for fds in pipes.values():
            for r, _ in fds:
                os.close(r)
        raise
    finally:  # our copies of the workers' ends: each pipe's only writer (or reader) is now its worker
        for fds in theirs.values():
            for fd in fds:
                os.close(fd)
    panels = None if out_stream is not sys.stdout else RankPanels.for_this_kernel(world_size)  # none when quiet
    for rank, worker in sorted(workers.items()):
        (out_r, _), (err_r, _), (progress_r, _) = pipes[rank]
        supervision.slots.append(RankSlot(rank, worker, RankStream(out_r, rank, out_stream, panels=panels),
                                          RankStream(err_r, rank, err_stream, keep_tail=True, panels=panels),
                                          NoticeReader(progress_r)))
