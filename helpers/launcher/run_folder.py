"""The run folder: every file that passes between the kernel and its ranks, named, written and read here only.

Why files: what a launch sends (a function and its arguments, the kernel's state) and what a rank sends back (a
return value that may be a whole state dict, an exception) can be large, and a rank may die at any moment. A file
that exists here is complete (written beside, then renamed), so no side ever reads half of one, and a result
written before its rank hangs on the way out is never lost. Why one module: the kernel and every rank must agree on
each name and format, and reading them in one place is how a newcomer finds what travels.

    <run folder>/        a private temporary folder: one per `launch`, one per `Workers` (its ranks' life)
      payload.pkl        kernel -> ranks: (fn, args, kwargs), by value, with the source lines of its code (`launch`)
      spec.pkl           kernel -> ranks: the kernel's state at launch time (environment, cwd, sys.path, threads)
      result.<rank>      rank -> kernel: what the function returned (cloudpickle; device tensors on the CPU)
      error.<rank>       rank -> kernel: what it raised (type, message, traceback, time, the exception if it pickles)
      stack.<rank>       rank -> kernel: faulthandler's dump of its threads, on STACK_SIGNAL (a timeout's evidence)
      store.<k>          rank <-> rank: the k-th env:// rendezvous's FileStore (`rendezvous`), written by torch
      call.<n>/          `Workers` only: call number n's call.pkl (kernel -> ranks), result.<rank>, error.<rank>
                         and store.<k>; the stacks stay at the top

The payload (`pack_payload`): a worker must show where it failed or hung, as file, line and source line, in its
traceback, in the stacks a timeout takes (faulthandler prints each frame's `co_filename`) and in a `Workers` error.
Two things stand in the way. (1) cloudpickle rebuilds a cell's function from its code object and, since 3.1.3,
writes `"<dynamic-code>"` as every such code object's file name (it makes its payloads deterministic); earlier
releases kept the name. (2) The source of a Jupyter cell lives only in the kernel's `linecache` (ipykernel
registers each cell under a file name that is not on disk), so a worker could never print its lines. So the kernel
pickles with a `cloudpickle.Pickler` whose `reducer_override` (the pickle protocol's own hook, which takes priority
over any reducer a pickler registers) sends every code object through `marshal`, the format CPython's .pyc files
use: it keeps every field, `co_filename` included, and the code objects nested in `co_consts` (inner functions,
lambdas, comprehensions). The kernel and its workers run the same interpreter (the fork-server and a spawned worker
both start `sys.executable`), so marshal's per-version format is safe here. Beside the pickle travel the source
lines of every file those code objects name, as the kernel's `linecache` knows them; the worker enters them in its
own `linecache` before it unpickles, so its tracebacks show the lines that were launched. Nothing here depends on
how a cloudpickle release reduces code objects: tests check both an erasing and a keeping reducer.

A result is pickled with device tensors brought to the CPU: a CUDA tensor unpickled in the kernel would initialise
CUDA there and make every later fork unsafe.
"""
from __future__ import annotations

import io
import linecache
import marshal
import os
import pickle
import signal
import sys
import time
import traceback
import types

from helpers.launcher.errors import RankFailure

RUN_DIR_VAR = "COOKBOOK_RUN_DIR"  # the run folder, in every worker's environment
OUTCOMES = ("result", "error")
# What makes a rank's faulthandler write its threads' stacks to its stack file (`stack.<rank>`): the kernel sends it
# to the ranks still running when it gives up; each rank registered it at its start. None where there is no SIGUSR1.
STACK_SIGNAL = getattr(signal, "SIGUSR1", None)


def rank_file(directory: str, kind: str, rank: int) -> str:
    """Where rank `rank` writes its `kind` ('result', 'error', 'stack') in a run folder (or a call's folder)."""
    return os.path.join(directory, f"{kind}.{rank}")


def store_file(directory: str, number: int) -> str:
    """The FileStore of the `number`-th env:// rendezvous in a run folder (or a call's folder)."""
    return os.path.join(directory, f"store.{number}")


def write_atomically(file: str, data) -> None:
    """The launcher takes a file's existence to mean it is complete: write beside it, then rename."""
    with open(file + ".tmp", "wb") as f:
        f.write(data)
    os.replace(file + ".tmp", file)


# -------------------------------------------------------------------------------------------------- the payload
def _payload_pickler(buffer, files: set):
    """cloudpickle, with code objects kept whole (marshal) and their file names collected in `files`."""
    import cloudpickle

    class Pickler(cloudpickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, types.CodeType):
                files.update(_file_names(obj))
                return marshal.loads, (marshal.dumps(obj),)
            return super().reducer_override(obj)

    return Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)


def _file_names(code: types.CodeType) -> set[str]:
    """The file names of `code` and of every code object nested in it."""
    names = {code.co_filename}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _file_names(const)
    return names


def pack_payload(obj) -> bytes:
    """`obj` pickled by value, with the source lines of every file its code objects come from."""
    buffer, files = io.BytesIO(), set()
    _payload_pickler(buffer, files).dump(obj)
    sources = {name: lines for name in sorted(files) if (lines := linecache.getlines(name))}
    return pickle.dumps({"sources": sources, "pickled": buffer.getvalue()}, protocol=pickle.HIGHEST_PROTOCOL)


def unpack_payload(data: bytes):
    """What `pack_payload` packed; the sources it carries are entered in this process's `linecache` first."""
    import cloudpickle

    record = pickle.loads(data)
    for name, lines in record["sources"].items():
        # mtime None: `linecache.checkcache` keeps the entry although no such file (a cell's) is on disk
        linecache.cache[name] = (sum(map(len, lines)), None, list(lines), name)
    return cloudpickle.loads(record["pickled"])


def _read_payload(file: str):
    with open(file, "rb") as f:
        return unpack_payload(f.read())


# --------------------------------------------------------------------------------- a launch: kernel -> ranks
def write_launch(run_dir: str, fn, args: tuple, kwargs: dict, worker_env: dict, threads: int,
                 loopback_store: bool) -> None:
    """What every worker reads after it starts: the function with its arguments (none for persistent ranks, which
    take their calls from `write_call`), and the kernel's state now."""
    if fn is not None:
        write_atomically(os.path.join(run_dir, "payload.pkl"), pack_payload((fn, args, kwargs)))
    spec = {"env": worker_env, "cwd": os.getcwd(), "sys_path": list(sys.path), "threads": threads,
            "loopback_store": loopback_store}
    write_atomically(os.path.join(run_dir, "spec.pkl"), pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL))


def read_spec(run_dir: str) -> dict:
    """The kernel's state as `write_launch` recorded it: env, cwd, sys_path, threads, loopback_store."""
    with open(os.path.join(run_dir, "spec.pkl"), "rb") as f:
        return pickle.load(f)


def read_launch(run_dir: str) -> tuple:
    """(fn, args, kwargs) as `write_launch` recorded them."""
    return _read_payload(os.path.join(run_dir, "payload.pkl"))


def write_call(run_dir: str, call: int, request: tuple) -> str:
    """`Workers`: call number `call`'s folder, made and holding its request; returns the folder."""
    call_dir = os.path.join(run_dir, f"call.{call}")
    os.mkdir(call_dir)
    write_atomically(os.path.join(call_dir, "call.pkl"), pack_payload(request))
    return call_dir


def read_call(call_dir: str) -> tuple:
    """The request `write_call` recorded."""
    return _read_payload(os.path.join(call_dir, "call.pkl"))


# ------------------------------------------------------------------------------- an outcome: rank -> kernel
def _result_pickler(buffer):
    """cloudpickle (notebook-defined classes travel by value), with device tensors brought to the CPU."""
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


def write_error(directory: str, rank: int, exc: BaseException, tb: str | None = None) -> str:
    """Record `exc` (with the traceback being handled, unless `tb` is given) as rank's error; returns 'error'."""
    tb = traceback.format_exc() if tb is None else tb
    write_atomically(rank_file(directory, "error", rank),
                     pickle.dumps(_error_record(rank, exc, tb), protocol=pickle.HIGHEST_PROTOCOL))
    return "error"


def write_result(directory: str, rank: int, result) -> str:
    """Record `result` as rank's result ('result'), or, if it cannot be pickled, an error that says so ('error')."""
    buffer = io.BytesIO()
    try:
        _result_pickler(buffer).dump(result)
    except Exception as exc:  # noqa: BLE001
        message = (f"rank {rank} returned a value that cannot be pickled ({type(result).__qualname__}): "
                   f"{type(exc).__name__}: {exc}")
        return write_error(directory, rank, TypeError(message))
    write_atomically(rank_file(directory, "result", rank), buffer.getbuffer())
    return "result"


def reported(directory: str, rank: int) -> bool:
    """Whether the rank has written its result or its error."""
    return any(os.path.exists(rank_file(directory, kind, rank)) for kind in OUTCOMES)


def read_outcome(directory: str, rank: int) -> tuple[str, object] | None:
    """('result', value) or ('error', RankFailure) as the rank wrote it; None if it wrote neither.

    A result that cannot be unpickled here comes back as a failure that says so."""
    result_file, error_file = rank_file(directory, "result", rank), rank_file(directory, "error", rank)
    if os.path.exists(result_file):
        try:
            with open(result_file, "rb") as f:
                return "result", pickle.loads(f.read())
        except Exception as exc:  # noqa: BLE001
            return "error", RankFailure(rank, "TypeError", f"the return value of rank {rank} could not be unpickled "
                                                           f"in the kernel: {type(exc).__name__}: {exc}",
                                        time=time.time())
    if not os.path.exists(error_file):
        return None
    with open(error_file, "rb") as f:
        record = pickle.loads(f.read())
    original = None
    if record.get("exception"):
        try:
            original = pickle.loads(record["exception"])
        except Exception:  # noqa: BLE001
            original = None
    return "error", RankFailure(rank, record["type"], record["message"], record["traceback"], record["time"],
                                original)


def read_stack(run_dir: str, rank: int) -> str:
    """What the rank's faulthandler has written of its stacks so far ('' if nothing)."""
    try:
        with open(rank_file(run_dir, "stack", rank)) as f:
            return f.read()
    except OSError:
        return ""


def stack_size(run_dir: str, rank: int) -> int:
    try:
        return os.path.getsize(rank_file(run_dir, "stack", rank))
    except OSError:
        return 0
