"""The rank's side of the launcher: what a worker process runs, from its first line to its exit.

A worker starts as a fork of the launcher's server (or as a spawned interpreter), never of the kernel. It takes
on the kernel's state *at launch time* (environment, current directory, sys.path, read from the run folder),
a fresh process's random state, and `threads` intra-op threads. It gets its own session (one signal stops it and
everything it started), line-buffered stdout and stderr on the launcher's pipes (each line reaches the cell at
once), a faulthandler that dumps its Python stack on STACK_SIGNAL (how a timeout shows where each rank was stuck),
and it reports its return value or its exception through a file in the run folder (`run_folder`), then says so on
its progress pipe (`protocol`). Its function and arguments are unpickled (by value, with their file names and
source lines) here, after the fork, never in the server. It is a child subreaper, and ends everything it started
before it exits (`sessions`).

Two kinds of rank run here: `launch`'s, which call one function (`run_worker`), and `Workers`' persistent ones,
which serve the calls their command pipe brings until the kernel closes it (`serve_calls`). Both call and report
through `call_and_write`. The function's local variables outlive its return until the result is written
(`call_keeping_locals` says why); the launcher then stops a rank that does not exit (see `api.EXIT_GRACE_S`).
Nothing here imports the kernel's side of the launcher: the two sides share only `protocol`, `run_folder`,
`errors`, `sessions` and `rendezvous`.
"""
from __future__ import annotations

import ast
import builtins
import faulthandler
import gc
import io
import linecache
import os
import signal
import sys
import time
import types

from helpers.launcher import rendezvous, run_folder, sessions
from helpers.launcher.protocol import PROGRESS_FD_VAR, CallDone, Progress, Reported, receive_call, send_notice
from helpers.launcher.run_folder import STACK_SIGNAL


def report_progress(step: int, total: int, **metrics: float) -> None:
    """Tell the launcher (or the terminal) how far this rank is. Cheap enough to call every step.

    Launched by `helpers.launch`, the state goes to the rank's progress pipe, drawn per rank in the cell; under
    torchrun (or anything else) a line is printed every tenth of the work."""
    progress = Progress(int(step), int(total), time.time(), {k: float(v) for k, v in metrics.items()})
    if send_notice(progress):
        return
    tenth = max(1, total // 10)
    if step % tenth == 0 or step == total:
        shown = " ".join(f"{k}={v:.4g}" for k, v in progress.metrics.items())
        print(f"[rank {os.environ.get('RANK', '0')}] {step}/{total} {shown}", flush=True)


def _line_buffered_std_streams() -> None:
    """fds 1 and 2 are the launcher's pipes: wrap them so every line reaches the cell as soon as it is printed."""
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    sys.stdin = open(0, closefd=False)
    sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), encoding="utf-8",
                                  errors="backslashreplace", line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False), encoding="utf-8",
                                  errors="backslashreplace", line_buffering=True, write_through=True)
    sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr


def _fresh_random_state() -> None:
    """Seed Python's, numpy's and torch's global generators from the OS, as a freshly started process is.

    A forked worker would otherwise share the server's generator states with every other rank and every other
    launch. (Seed explicitly in your function when ranks must agree, as a training script does.)
    """
    import random

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()


def _die_with_parent(parent_pid: int) -> None:
    """Linux: be killed if the kernel dies (a kernel restart is a SIGKILL: its `finally` never runs)."""
    if sessions.prctl(sessions.PR_SET_PDEATHSIG, signal.SIGKILL) and os.getppid() != parent_pid:
        os._exit(1)  # the parent died before prctl took effect


def _publish_in_main(fn) -> None:
    """Give this process's __main__ the cell globals fn uses (functions, classes), as a fork of the kernel had.

    Why: cloudpickle rebuilds a cell's function and what it references by value, but libraries that pickle by
    *name* (torch.distributed.rpc sends `__main__.Counter`, multiprocessing pickles `__main__.f`) look the name up
    in the receiving process's __main__, where it would otherwise not exist.
    """
    if getattr(fn, "__module__", None) != "__main__" or not hasattr(fn, "__globals__"):
        return
    main = sys.modules["__main__"].__dict__
    for name, value in fn.__globals__.items():
        if not name.startswith("__"):
            main.setdefault(name, value)


def call_keeping_locals(fn, args, kwargs, kept: list):
    """`fn(*args, **kwargs)`, with fn's frame appended to `kept`: its locals stay alive until `kept` is cleared.

    Why: freeing a function's locals is where a finished rank can deadlock (a gloo process group whose last
    reference a DDP reducer drops, with the GIL held, while a gloo worker thread waits for the GIL to release a
    tensor); a result written first cannot be lost to such a hang.

    A profile hook catches only the first Python call (fn's own frame) and removes itself, so fn runs at full
    speed. A frame object that is still referenced when its function returns keeps the locals (CPython copies them
    into the frame object). The cyclic garbage collector is off from fn's return on, so no garbage fn left behind
    is freed either: nothing fn made runs a destructor before the caller has written the result (the caller
    clears `kept` and turns the collector back on).
    """
    previous = sys.getprofile()

    def keep_first_frame(frame, event, arg):
        if event == "call":
            kept.append(frame)
            sys.setprofile(previous)

    sys.setprofile(keep_first_frame)
    try:
        return fn(*args, **kwargs)
    finally:
        gc.disable()
        sys.setprofile(previous)  # a builtin fn makes no Python call: the hook must not outlive it


def call_and_write(fn, args, kwargs, directory: str, rank: int, kept: list) -> str:
    """Run fn (its locals kept in `kept`), write its result or its exception to `directory`; returns 'result' or
    'error'. Every exception is the rank's failure, SystemExit and KeyboardInterrupt included."""
    try:
        result = call_keeping_locals(fn, args, kwargs, kept)
    except BaseException as exc:  # noqa: BLE001
        return run_folder.write_error(directory, rank, exc)
    return run_folder.write_result(directory, rank, result)


def run_worker(run_dir: str, rank: int, parent_pid: int, progress_fd: int, command_fd: int | None = None) -> None:
    """Entry point of every worker (forked by the server, or spawned). Never returns: ends with os._exit."""
    try:
        if hasattr(os, "setsid"):
            try:
                os.setsid()
            except PermissionError:  # spawned with start_new_session: already a session leader
                pass
        _die_with_parent(parent_pid)
        sessions.become_subreaper()  # what the rank starts stays in its tree, to be ended with it
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _line_buffered_std_streams()
        faulthandler.enable(file=sys.stderr, all_threads=True)
        if STACK_SIGNAL is not None:
            stack_file = open(run_folder.rank_file(run_dir, "stack", rank), "w")
            faulthandler.register(STACK_SIGNAL, file=stack_file, all_threads=True, chain=False)
        spec = run_folder.read_spec(run_dir)
        # the kernel's state at launch time, as a fork of the kernel would have seen it
        os.environ.clear()
        os.environ.update(spec["env"])
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                           PROGRESS_FD_VAR: str(progress_fd)})
        os.chdir(spec["cwd"])
        sys.path[:] = spec["sys_path"]
        _fresh_random_state()
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.set_num_threads(spec["threads"])
            import torch.distributed as dist

            if dist.is_available():  # read when torch was imported in the server: re-read the launch's value
                dist.set_debug_level_from_env()
        if spec["loopback_store"]:
            if not rendezvous.install(run_dir):
                print("helpers.launch: torch's rendezvous registry changed; env:// uses TCPStore "
                      "(listening on all interfaces)", file=sys.stderr)
        if command_fd is None:
            fn, args, kwargs = run_folder.read_launch(run_dir)
            _publish_in_main(fn)
        else:  # a persistent rank (`Workers`): its calls arrive on this pipe
            fn, args, kwargs = serve_calls, (command_fd,), {}
    except BaseException as exc:  # noqa: BLE001 - a broken start must still be reported
        send_notice(Reported(run_folder.write_error(run_dir, rank, exc)))
        _exit(1)

    kept: list = []
    reported = "error"
    try:
        reported = call_and_write(fn, args, kwargs, run_dir, rank, kept)
        send_notice(Reported(reported))
    finally:
        kept.clear()  # fn's objects are freed now, as at the end of a torchrun script: files flush, temp dirs go
        _exit(0 if reported == "result" else 1)


def _exit(code: int) -> None:
    """End what the rank started (its subprocesses, DataLoader workers, compile pools), flush, and exit."""
    try:
        sessions.end_descendants()
    except Exception:  # noqa: BLE001 - psutil missing: the launcher's session kill still reaches the session
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


def spawn_main(run_dir: str, rank: int, progress_fd: int, command_fd: int | None = None) -> None:
    """Entry point of a spawned worker: a fresh interpreter, child of the kernel, that imports torch itself."""
    import torch  # noqa: F401 - what the fork-server has preloaded, so both start methods set up alike

    run_worker(run_dir, rank, parent_pid=os.getppid(), progress_fd=progress_fd, command_fd=command_fd)


# ------------------------------------------------------------------------------------- a persistent rank's calls
def _rank_globals(namespace: dict, fn, owned: set) -> dict:
    """The kernel's current globals for the names fn uses, except those this rank's own code assigned."""
    for name, value in getattr(fn, "__globals__", {}).items():
        if name not in owned and not name.startswith("__"):
            namespace[name] = value
    return namespace


def serve_calls(command_fd: int) -> None:
    """What a persistent rank runs: take calls from its command pipe until the kernel closes it (`workers` says
    which name wins when the kernel and the rank both have one)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a cell interrupt ends the call, not the rank
    rank = int(os.environ["RANK"])
    namespace: dict = {"__name__": "__rank__", "__builtins__": builtins}
    owned: set = set()
    while True:
        call = receive_call(command_fd)
        if call is None:
            return  # the kernel closed the pipe: Workers.close()
        rendezvous.install(call.dir)  # a fresh file store per call: init_process_group in every call works
        before = dict(namespace)  # taken again once the kernel's globals are in: what changes after is the rank's
        kept: list = []
        try:
            request = run_folder.read_call(call.dir)
            if request[0] == "function":
                _, fn, args, kwargs = request
                if isinstance(fn, types.FunctionType):
                    bound = types.FunctionType(fn.__code__, _rank_globals(namespace, fn, owned), fn.__name__,
                                               fn.__defaults__, fn.__closure__)
                    bound.__kwdefaults__ = fn.__kwdefaults__
                    fn = bound
                    before = dict(namespace)
            else:
                _, source, name = request
                linecache.cache[name] = (len(source), None, source.splitlines(True), name)
                fn, args, kwargs = _run_source, (source, name, namespace), {}
        except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt too: the rank stays
            reported = run_folder.write_error(call.dir, rank, exc)
        else:
            reported = call_and_write(fn, args, kwargs, call.dir, rank, kept)
        finally:
            kept.clear()
            gc.enable()  # call_keeping_locals turns it off until the result is written
        owned |= {k for k, v in namespace.items() if k not in before or before[k] is not v}
        send_notice(CallDone(call.call, reported))


def _run_source(source: str, name: str, namespace: dict):
    """exec the cell in the rank's namespace; the value of a final expression, as IPython shows it."""
    tree = ast.parse(source, name)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, name, "exec"), namespace)
    if last is None:
        return None
    return eval(compile(ast.Expression(last.value), name, "eval"), namespace)
