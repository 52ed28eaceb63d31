"""The first code a worker process runs: make it look like a torchrun worker, run the cell's function, report.

Why this is careful: a worker forked from a Jupyter kernel inherits the kernel's ZMQ-backed sys.stdout, its signal
handlers and its process group. Left alone, a print would write into the kernel's sockets, a cell interrupt would
raise KeyboardInterrupt in every worker, and a killed worker's children would outlive it. So the worker gets its
own session (one signal kills it and everything it started), plain files as stdout and stderr (the launcher tails
them, so output can never fill a pipe and block), a faulthandler that dumps its Python stack on SIGUSR1 (how a
timeout shows where each rank was stuck), and it reports its return value or its exception through a file.

The function's local variables outlive its return until the result is written (`_call_keeping_locals`): freeing
them is where a finished rank can deadlock (a gloo process group whose last reference a DDP reducer drops, with
the GIL held, while a gloo worker thread waits for the GIL to release a tensor), and a result written first
cannot be lost to such a hang; the launcher then stops a rank that does not exit (see `launch.EXIT_GRACE_S`).
"""
from __future__ import annotations

import faulthandler
import gc
import io
import os
import pickle
import signal
import sys
import time
import traceback

STACK_SIGNAL = getattr(signal, "SIGUSR1", None)


def _reopen_std_streams(out_path: str, err_path: str) -> None:
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(target, fd)
        os.close(target)
    old_stdout, old_stderr = sys.stdout, sys.stderr
    sys.stdin = open(0, closefd=False)
    sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), encoding="utf-8",
                                  errors="backslashreplace", line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False), encoding="utf-8",
                                  errors="backslashreplace", line_buffering=True, write_through=True)
    old_streams = {id(sys.__stdout__), id(sys.__stderr__), id(old_stdout), id(old_stderr)}
    sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr
    _repoint_logging(old_streams)


def _repoint_logging(old_streams: set[int]) -> None:
    """Logging handlers the kernel made before the fork still hold its streams: point them at this rank's."""
    import logging

    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    for logger in loggers:
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                stream = getattr(handler, "stream", None)
                if stream is not None and (id(stream) in old_streams or type(stream).__name__ == "OutStream"
                                           or _is_std_fd(stream)):
                    handler.setStream(sys.stderr)


def _is_std_fd(stream) -> bool:
    try:
        return stream.fileno() in (1, 2)
    except Exception:  # noqa: BLE001 - an in-memory stream: leave it alone
        return False


def _dump(path: str, record: dict) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL))
    os.replace(path + ".tmp", path)


def _result_pickler(buffer):
    """cloudpickle (notebook-defined classes travel by value), with device tensors brought to the CPU.

    A CUDA tensor unpickled in the kernel would initialise CUDA there and make every later fork unsafe.
    """
    import cloudpickle

    class Pickler(cloudpickle.Pickler):
        def reducer_override(self, obj):
            torch = sys.modules.get("torch")
            if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
                return obj.detach().cpu().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
            return super().reducer_override(obj)

    return Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)


def _error_record(rank: int, exc: BaseException, tb: str) -> dict:
    record = {"rank": rank, "type": type(exc).__qualname__, "module": type(exc).__module__,
              "message": str(exc), "traceback": tb, "time": time.time(), "exception": None}
    if isinstance(exc, SystemExit):
        record["message"] = f"the worker called sys.exit({exc.code!r}) instead of returning"
    try:
        record["exception"] = pickle.dumps(exc)
        pickle.loads(record["exception"])
    except Exception:
        record["exception"] = None
    return record


def _die_with_parent(parent_pid: int) -> None:
    """Linux: be killed if the kernel dies (a kernel restart is a SIGKILL: its `finally` never runs)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _call_keeping_locals(fn, args, kwargs, kept: list):
    """`fn(*args, **kwargs)`, with fn's frame appended to `kept`: its locals stay alive until `kept` is cleared.

    A profile hook catches only the first Python call (fn's own frame) and removes itself, so fn runs at full
    speed. A frame object that is still referenced when its function returns keeps the locals (CPython copies them
    into the frame object). The cyclic garbage collector is off from fn's return on, so no garbage fn left behind
    is freed either: nothing fn made runs a destructor before the caller has written the result.
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


def run_worker(payload, rank: int, spec: dict) -> None:
    """Entry point of every worker (fork or spawn). Never returns: ends the process with os._exit."""
    run_dir = spec["run_dir"]
    exit_code = 1
    try:
        if hasattr(os, "setsid"):
            try:
                os.setsid()
            except PermissionError:  # spawned with start_new_session: already a session leader
                pass
        _die_with_parent(spec["parent_pid"])
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _reopen_std_streams(os.path.join(run_dir, f"out.{rank}"), os.path.join(run_dir, f"err.{rank}"))
        faulthandler.enable(file=sys.stderr, all_threads=True)
        if STACK_SIGNAL is not None:
            stack_file = open(os.path.join(run_dir, f"stack.{rank}"), "w")
            faulthandler.register(STACK_SIGNAL, file=stack_file, all_threads=True, chain=False)
        os.environ.update(spec["env"])
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank)})

        if "torch.distributed" in sys.modules and sys.modules["torch.distributed"].is_available():
            # forked: torch.distributed read TORCH_DISTRIBUTED_DEBUG when the kernel imported it; re-read it so
            # launch(env={"TORCH_DISTRIBUTED_DEBUG": ...}) acts as it does under torchrun.
            sys.modules["torch.distributed"].set_debug_level_from_env()
        if "torch" in sys.modules:  # forked: torch's thread pool size was fixed by the parent
            sys.modules["torch"].set_num_threads(int(spec["env"]["OMP_NUM_THREADS"]))
        if spec["loopback_store"]:
            from helpers.launcher import rendezvous as loopback_rendezvous

            if not loopback_rendezvous.install(run_dir):
                print("helpers.launch: torch's rendezvous registry changed; env:// uses TCPStore "
                      "(listening on all interfaces)", file=sys.stderr)
        if isinstance(payload, bytes):  # spawn: the function travelled by value
            import cloudpickle

            payload = cloudpickle.loads(payload)
        fn, args, kwargs = payload
    except BaseException as exc:  # noqa: BLE001 - a broken start must still be reported
        _dump(os.path.join(run_dir, f"error.{rank}"), _error_record(rank, exc, traceback.format_exc()))
        os._exit(1)

    kept: list = []
    try:
        result = _call_keeping_locals(fn, args, kwargs, kept)
    except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt are failures too
        _dump(os.path.join(run_dir, f"error.{rank}"), _error_record(rank, exc, traceback.format_exc()))
    else:
        buffer = io.BytesIO()
        try:
            _result_pickler(buffer).dump(result)
        except Exception as exc:  # noqa: BLE001
            exc_message = (f"rank {rank} returned a value that cannot be pickled "
                           f"({type(result).__qualname__}): {type(exc).__name__}: {exc}")
            _dump(os.path.join(run_dir, f"error.{rank}"),
                  _error_record(rank, TypeError(exc_message), traceback.format_exc()))
        else:
            path = os.path.join(run_dir, f"result.{rank}")
            with open(path + ".tmp", "wb") as f:
                f.write(buffer.getbuffer())
            os.replace(path + ".tmp", path)
            exit_code = 0
    finally:
        kept.clear()  # fn's objects are freed now, as at the end of a torchrun script: files flush, temp dirs go
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(exit_code)


def spawn_main(run_dir: str, rank: int) -> None:
    """Entry point of a spawned worker: a fresh interpreter that never imports the kernel's __main__."""
    with open(os.path.join(run_dir, "spec.pkl"), "rb") as f:
        spec = pickle.load(f)
    sys.path[:] = spec["sys_path"]
    with open(os.path.join(run_dir, "payload.pkl"), "rb") as f:
        payload = f.read()
    run_worker(payload, rank, spec)
