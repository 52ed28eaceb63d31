"""A launched function keeps its file names and source lines whatever the pickler does to code objects.

cloudpickle 3.1.3 writes "<dynamic-code>" as the file name of every code object it pickles by value; earlier
releases kept it. Both behaviours are simulated here with a code reducer in cloudpickle's dispatch table, so the
tests hold under whichever release is installed."""
from __future__ import annotations

import linecache
import marshal
import types

import cloudpickle
import pytest

from helpers.launcher import WorkerError, launch, run_folder

CELL = "/tmp/ipykernel_0/cell_not_on_disk.py"
CELL_SOURCE = ("def outer(x):\n"
               "    def inner(y):\n"
               "        raise ValueError(f'inner got {y}')  # the line a traceback must show\n"
               "    return inner(x + 1)\n")


def _erasing(code):
    """What cloudpickle >= 3.1.3 does: the code object travels with another file name."""
    return marshal.loads, (marshal.dumps(code.replace(co_filename="<dynamic-code>")),)


def _keeping(code):
    """What cloudpickle < 3.1.3 does: the file name travels."""
    return marshal.loads, (marshal.dumps(code),)


@pytest.fixture(params=[_erasing, _keeping], ids=["erasing-pickler", "keeping-pickler"])
def code_reducer(request, monkeypatch):
    monkeypatch.setitem(cloudpickle.Pickler.dispatch_table, types.CodeType, request.param)
    return request.param


@pytest.fixture
def cell_function():
    """A function defined in a 'Jupyter cell': its source is in linecache only, as ipykernel registers it."""
    linecache.cache[CELL] = (len(CELL_SOURCE), None, CELL_SOURCE.splitlines(True), CELL)
    namespace = {"__name__": "__main__"}
    exec(compile(CELL_SOURCE, CELL, "exec"), namespace)
    yield namespace["outer"]
    linecache.cache.pop(CELL, None)


def test_the_simulated_erasing_pickler_does_erase(monkeypatch, cell_function):
    """The simulation is faithful: plain cloudpickle with the erasing reducer loses the file name."""
    monkeypatch.setitem(cloudpickle.Pickler.dispatch_table, types.CodeType, _erasing)
    assert cloudpickle.loads(cloudpickle.dumps(cell_function)).__code__.co_filename == "<dynamic-code>"


def test_file_names_of_nested_code_survive_and_sources_travel(code_reducer, cell_function):
    data = run_folder.pack_payload((cell_function, (1,), {}))
    linecache.cache.pop(CELL)  # a worker has never seen the cell
    fn, args, kwargs = run_folder.unpack_payload(data)
    assert fn.__code__.co_filename == CELL
    inner = next(c for c in fn.__code__.co_consts if isinstance(c, types.CodeType))
    assert inner.co_name == "inner" and inner.co_filename == CELL
    assert "the line a traceback must show" in linecache.getline(CELL, 3)
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    assert "the line a traceback must show" in "".join(info.traceback[-1].statement.lines)


def test_a_workers_traceback_shows_the_cells_file_and_line(code_reducer, cell_function):
    with pytest.raises(WorkerError) as info:
        launch(cell_function, 1, world_size=1, timeout=60)
    assert f'File "{CELL}", line 3, in inner' in info.value.traceback
    assert "raise ValueError(f'inner got {y}')  # the line a traceback must show" in info.value.traceback


def test_a_persistent_ranks_error_shows_the_cells_file_and_line(code_reducer, cell_function):
    from helpers.launcher import Workers

    with Workers(1) as workers, pytest.raises(WorkerError) as info:
        workers.run(cell_function, 1, timeout=60)
    assert f'File "{CELL}", line 3, in inner' in info.value.traceback
    assert "# the line a traceback must show" in info.value.traceback
