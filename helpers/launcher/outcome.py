"""A rank's outcome: its return value or its exception, written by the rank to a file the supervisor reads.

Why files, and one module for both ends: a result may be large (a state dict), and a rank may die at any moment;
a file that exists is complete (written beside, then renamed), so the supervisor never reads half a result, and a
result written before the rank hangs on its way out is never lost. `launch`'s ranks (`worker.run_worker`) and
`Workers`' ranks (`workers.serve_calls`, one folder per call) report through `call_and_write`, and the supervisor
reads with `read`: one format, one place.

The function's local variables outlive its return until the result is written (`call_keeping_locals`): freeing
them is where a finished rank can deadlock (a gloo process group whose last reference a DDP reducer drops, with
the GIL held, while a gloo worker thread waits for the GIL to release a tensor), and a result written first
cannot be lost to such a hang; the launcher then stops a rank that does not exit (see `api.EXIT_GRACE_S`).
"""
from __future__ import annotations

import gc
import io
import os
import pickle
import sys
import time
import traceback

KINDS = ("result", "error")


def path(directory: str, kind: str, rank: int) -> str:
    """Where rank `rank` writes its `kind` ('result', 'error'; 'stack': its faulthandler dumps) in a launch's
    (or a call's) folder."""
    return os.path.join(directory, f"{kind}.{rank}")


def reported(directory: str, rank: int) -> bool:
    return any(os.path.exists(path(directory, kind, rank)) for kind in KINDS)


def write_atomically(file: str, data) -> None:
    """The launcher takes a file's existence to mean it is complete: write beside it, then rename."""
    with open(file + ".tmp", "wb") as f:
        f.write(data)
    os.replace(file + ".tmp", file)


# ------------------------------------------------------------------------------------------- the rank's side
def result_pickler(buffer):
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


def error_record(rank: int, exc: BaseException, tb: str) -> dict:
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
    write_atomically(path(directory, "error", rank),
                     pickle.dumps(error_record(rank, exc, tb), protocol=pickle.HIGHEST_PROTOCOL))
    return "error"


def write_result(directory: str, rank: int, result) -> str:
    """Record `result` as rank's result ('result'), or, if it cannot be pickled, an error that says so ('error')."""
    buffer = io.BytesIO()
    try:
        result_pickler(buffer).dump(result)
    except Exception as exc:  # noqa: BLE001
        message = (f"rank {rank} returned a value that cannot be pickled ({type(result).__qualname__}): "
                   f"{type(exc).__name__}: {exc}")
        return write_error(directory, rank, TypeError(message))
    write_atomically(path(directory, "result", rank), buffer.getbuffer())
    return "result"


def call_keeping_locals(fn, args, kwargs, kept: list):
    """`fn(*args, **kwargs)`, with fn's frame appended to `kept`: its locals stay alive until `kept` is cleared.

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
    """Run fn (its locals kept in `kept`), write its result or its exception; returns 'result' or 'error'.

    Every exception is the rank's failure, SystemExit and KeyboardInterrupt included."""
    try:
        result = call_keeping_locals(fn, args, kwargs, kept)
    except BaseException as exc:  # noqa: BLE001
        return write_error(directory, rank, exc)
    return write_result(directory, rank, result)


# ------------------------------------------------------------------------------------------ the kernel's side
def read(directory: str, rank: int) -> tuple[str, object] | None:
    """('result', value) or ('error', record) as the rank wrote it; None if it wrote neither.

    A result that cannot be unpickled here comes back as an error record that says so."""
    result_path, error_path = path(directory, "result", rank), path(directory, "error", rank)
    if os.path.exists(result_path):
        try:
            with open(result_path, "rb") as f:
                return "result", pickle.loads(f.read())
        except Exception as exc:  # noqa: BLE001
            return "error", {"type": "TypeError", "traceback": "", "time": time.time(), "exception": None,
                             "message": f"the return value of rank {rank} could not be unpickled in the kernel: "
                                        f"{type(exc).__name__}: {exc}"}
    if os.path.exists(error_path):
        with open(error_path, "rb") as f:
            return "error", pickle.loads(f.read())
    return None
