"""Persistent ranks for interactive exploration: `Workers` and the `%%distributed` cell magic.

Why: exploring a process group from cells (make a tensor on every rank, all_reduce it, look, try again) with
`launch` restarts the ranks every time and loses their state. `Workers(world_size=2)` starts the ranks once, from
the same fork-server and with the same promises as `launch` (torchrun's environment, live rank-prefixed output,
the root cause of a failure, stacks at a timeout, nothing left running); `.run(fn, *args)` then costs
milliseconds. Each rank keeps one namespace, like a REPL: a function sent to it runs with that namespace as its
globals, so a global that one call sets (`global model; model = ...`) is there for the next call, and a
`%%distributed` cell runs as if typed into every rank's REPL.

Which name wins when the kernel and a rank both have one: a name the rank's code assigned (or created) is the
rank's; any other global the function uses comes from the kernel, current as of the call.

A function written for `launch` (it creates and destroys its own process group) runs unchanged under `.run`; one
may also keep its group for later calls. After an error every rank that reported is still usable; after a
timeout (or a rank's death) the ranks are stopped and the object says it must be restarted (`.restart()`).
Unlike nbdistributed's magic there is no cap on how long a cell may work, and errors are raised in the kernel.
Output a rank prints between calls (a background thread) appears at the start of the next call.

This module is the kernel's side; a persistent rank serves its calls with `rank.serve_calls`, and the two meet only
in `protocol` (a `Call` on each rank's command pipe, a `CallDone` back on its progress pipe) and the call's folder.
"""
from __future__ import annotations

import itertools
import linecache
import os
import signal
import sys
import tempfile

from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from helpers.launcher import run_folder
from helpers.launcher.api import DEFAULT_TIMEOUT, LaunchPlan, default_world_size, require_callable
from helpers.launcher.errors import WorkerError
from helpers.launcher.protocol import Call, send_call
from helpers.launcher.supervise import Supervision

INTERRUPT_GRACE_S = 5.0  # how long ranks get to answer a cell interrupt before they are stopped
CLOSE_GRACE_S = 5.0  # how long ranks get to return once their command pipe is closed


class WorkersStopped(RuntimeError):
    """The ranks were stopped (a timeout, a rank that died, `.close()`): create new Workers or `.restart()`."""


class Workers:
    """`world_size` ranks that stay alive between cells. Use as `with Workers(2) as w: w.run(fn)`, or keep one."""

    current: "Workers | None" = None  # the one `%%distributed` uses

    def __init__(self, world_size: int | None = None, *, backend: str | None = None, env: dict | None = None,
                 threads: int | None = None, start_method: str | None = None, timeout: float = DEFAULT_TIMEOUT):
        self.world_size = default_world_size() if world_size is None else world_size
        self.timeout = timeout
        self._options = dict(backend=backend, env=env, threads=threads, start_method=start_method)
        self._supervision: Supervision | None = None
        self._calls = itertools.count(1)
        self._start()
        Workers.current = self

    # -- lifecycle
    def _start(self) -> None:
        """A new plan each time (options validated, the kernel's environment as of now, a fresh port), the ranks
        serving calls."""
        plan = LaunchPlan.make(self.world_size, timeout=self.timeout, **self._options)
        self._dir = tempfile.TemporaryDirectory(prefix="cookbook-workers-")
        commands = {rank: os.pipe() for rank in range(self.world_size)}
        self._commands = {rank: w for rank, (_, w) in commands.items()}
        try:
            supervision = plan.start(self._dir.name, None, (), {}, sys.stdout, sys.stderr,
                                     command_fds={rank: r for rank, (r, _) in commands.items()})
        except BaseException:
            self._close_commands()
            self._dir.cleanup()
            raise
        self._supervision = supervision
        self.stopped_because: str | None = None

    def close(self) -> None:
        """Let every rank return, then stop whatever is left: no process remains."""
        supervision, self._supervision = self._supervision, None
        if supervision is None:
            return
        self._close_commands()  # a rank reading its command pipe sees the end and returns
        supervision.wait_exited(CLOSE_GRACE_S)
        supervision.finish()
        self._dir.cleanup()
        self.stopped_because = self.stopped_because or "closed"
        if Workers.current is self:
            Workers.current = None

    def restart(self) -> "Workers":
        self.close()
        self._start()
        Workers.current = self
        return self

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    @property
    def alive(self) -> bool:
        return self._supervision is not None

    @property
    def pids(self) -> list[int]:
        return self._supervision.pids if self._supervision else []

    def _close_commands(self) -> None:
        for fd in self._commands.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._commands = {}

    # -- calls
    def run(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        """`fn(*args, **kwargs)` on every rank, in the rank's namespace; the results ordered by rank."""
        require_callable(fn, "run")
        return self._call(("function", fn, args, kwargs), timeout)

    def run_cell(self, source: str, timeout: float | None = None) -> list:
        """A cell's code on every rank, as if typed there; the value of its last expression per rank."""
        compile(source, "<distributed cell>", "exec")  # a syntax error is the kernel's, before any rank runs
        return self._call(("source", source), timeout)

    def _call(self, request: tuple, timeout: float | None) -> list:
        supervision = self._supervision
        if supervision is None:
            raise WorkersStopped(f"these workers were stopped ({self.stopped_because}); call .restart() or create "
                                 "new Workers")
        call = next(self._calls)
        if request[0] == "source":
            name = f"<distributed cell {call}>"
            linecache.cache[name] = (len(request[1]), None, request[1].splitlines(True), name)
            request = ("source", request[1], name)
        call_dir = run_folder.write_call(supervision.run_dir, call, request)
        supervision.begin_call(sys.stdout, sys.stderr)
        for fd in self._commands.values():
            send_call(fd, Call(call, call_dir))
        try:
            return supervision.watch(timeout or self.timeout, call_dir, call).values()
        except KeyboardInterrupt:
            self._interrupt(supervision, call_dir, call)
            raise
        except WorkerError:
            self._stop_if_broken(supervision, "a rank died or hung after another failed")
            raise
        except BaseException:
            self._stop_if_broken(supervision, "a call timed out")
            raise
        finally:
            supervision.pump_all()

    def _interrupt(self, supervision: Supervision, call_dir: str, call: int) -> None:
        """Pass a cell interrupt on to the ranks (KeyboardInterrupt in their call); stop them if they don't end."""
        supervision.signal_ranks(signal.SIGINT)
        supervision.watch(INTERRUPT_GRACE_S, call_dir, call)  # what they report is not this cell's any more
        self._stop_if_broken(supervision, "a cell interrupt the ranks did not answer")

    def _stop_if_broken(self, supervision: Supervision, why: str) -> None:
        """Ranks that did not all report this call (stopped, dead, stuck) cannot take the next one."""
        if supervision.all_alive_and_done():
            return
        self.stopped_because = why
        self.close()
        self.stopped_because = why


# ------------------------------------------------------------------------------------------------ the magic
@magic_arguments("%distributed")  # a cell magic: shown as %%distributed
@argument("-n", "--world-size", type=int, default=None,
          help="ranks; other than the current Workers' (or none yet): new Workers of this size")
@argument("--timeout", type=float, default=None, help="seconds the cell may take (default: the Workers' timeout)")
def distributed_magic(line: str, cell: str):
    """%%distributed [-n WORLD_SIZE] [--timeout SECONDS]: run the cell on every rank of `Workers.current`."""
    args = parse_argstring(distributed_magic, line)
    workers = Workers.current
    if workers is None or not workers.alive or (args.world_size and args.world_size != workers.world_size):
        if workers is not None:
            workers.close()
        workers = Workers(args.world_size)
    values = workers.run_cell(cell, timeout=args.timeout)
    return None if all(v is None for v in values) else values


def load_ipython_extension(ipython) -> None:
    """`%load_ext helpers.launcher.workers` registers the `%%distributed` cell magic."""
    ipython.register_magic_function(distributed_magic, magic_kind="cell", magic_name="distributed")
