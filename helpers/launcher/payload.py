"""What travels from the kernel to the workers: a function and its arguments, by value, with file names and source.

Why a module: a worker must show where it failed or hung, as file, line and source line, in its traceback, in
the stacks a timeout takes (faulthandler prints each frame's `co_filename`) and in a `Workers` error. Two things
stand in the way. (1) cloudpickle rebuilds a cell's function from its code object and, since 3.1.3, writes
`"<dynamic-code>"` as every such code object's file name (it makes its payloads deterministic); earlier releases
kept the name. (2) The source of a Jupyter cell lives only in the kernel's `linecache` (ipykernel registers each
cell under a file name that is not on disk), so a worker could never print its lines.

So the kernel pickles with a `cloudpickle.Pickler` whose `reducer_override` (the pickle protocol's own hook, which
takes priority over any reducer a pickler registers) sends every code object through `marshal`, the format
CPython's .pyc files use: it keeps every field, `co_filename` included, and the code objects nested in
`co_consts` (inner functions, lambdas, comprehensions). The kernel and its workers run the same interpreter (the
fork-server and a spawned worker both start `sys.executable`), so marshal's per-version format is safe here.
Beside the pickle travel the source lines of every file those code objects name, as the kernel's `linecache`
knows them (a file on disk, a Jupyter cell, IPython's `<ipython-input-...>`); the worker enters them in its own
`linecache` before it unpickles, so its tracebacks show the lines that were launched. Nothing here depends on how
a cloudpickle release reduces code objects: tests check both an erasing and a keeping reducer.
"""
from __future__ import annotations

import io
import linecache
import marshal
import pickle
import types

from helpers.launcher import outcome


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


def dumps(obj) -> bytes:
    """`obj` pickled by value, with the source lines of every file its code objects come from."""
    buffer, files = io.BytesIO(), set()
    _payload_pickler(buffer, files).dump(obj)
    sources = {name: lines for name in sorted(files) if (lines := linecache.getlines(name))}
    return pickle.dumps({"sources": sources, "pickled": buffer.getvalue()}, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes):
    """What `dumps` packed; the sources it carries are entered in this process's `linecache` first."""
    import cloudpickle

    record = pickle.loads(data)
    for name, lines in record["sources"].items():
        # mtime None: `linecache.checkcache` keeps the entry although no such file (a cell's) is on disk
        linecache.cache[name] = (sum(map(len, lines)), None, list(lines), name)
    return cloudpickle.loads(record["pickled"])


def dump(obj, path: str) -> None:
    outcome.write_atomically(path, dumps(obj))


def load(path: str):
    with open(path, "rb") as f:
        return loads(f.read())
