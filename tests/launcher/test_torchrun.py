"""Unit tests of helpers.cluster.torchrun: a real torchrun, its exit status, its output, and the timeout."""
from __future__ import annotations

import time

import psutil
import pytest

from helpers.cluster.torchrun import run_torchrun, torchrun_path


def test_torchrun_is_the_one_beside_the_interpreter():
    import sys
    from pathlib import Path

    path = Path(torchrun_path())
    assert path.name == "torchrun"
    if Path(sys.executable).with_name("torchrun").exists():
        assert path == Path(sys.executable).with_name("torchrun")


def test_runs_a_script_and_reports_its_status(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("import os, sys\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])\n"
                      "import helpers\nsys.exit(3 if os.environ.get('FAIL') else 0)\n")
    ok = run_torchrun(script, nproc=1, echo=False, timeout=300)  # each run: about 8 s on a loaded 2-core machine
    assert ok.returncode == 0 and "rank 0 of 1" in ok.output
    bad = run_torchrun(script, nproc=1, echo=False, timeout=300, env={"FAIL": "1"})
    assert bad.returncode != 0


def test_timeout_stops_everything(tmp_path):
    """The worker must have started (printed its pid) before the timeout, which starts at 10 s: on a machine too busy
    for that (torchrun, then its worker, each import torch), the timeout is quadrupled and the run made again."""
    script = tmp_path / "sleepy.py"
    script.write_text("import os, time\nprint('worker pid', os.getpid(), flush=True)\ntime.sleep(600)\n")
    for timeout in (10, 40, 160):
        start = time.monotonic()
        with pytest.raises(TimeoutError) as info:
            run_torchrun(script, nproc=1, echo=False, timeout=timeout)
        if "worker pid" in str(info.value):
            break
    assert time.monotonic() - start < timeout + 30  # the timeout, then the teardown (about 3 s here)
    pid = int(str(info.value).split("worker pid")[1].split()[0])
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_error_files_reads_what_record_writes(tmp_path):
    import json

    from helpers.cluster.torchrun import error_files

    for rank, stamp in ((1, "1700000001"), (0, "1700000002")):
        folder = tmp_path / "run_id" / "attempt_0" / str(rank)
        folder.mkdir(parents=True)
        record = {"message": {"message": f"RuntimeError: boom on {rank}",
                              "extraInfo": {"py_callstack": "Traceback ...", "timestamp": stamp}}}
        (folder / "error.json").write_text(json.dumps(record))
    failures = error_files(tmp_path)
    assert [(f.rank, f.kind, f.time) for f in failures] == [(0, "RuntimeError", 1700000002.0),
                                                            (1, "RuntimeError", 1700000001.0)]
    assert error_files(tmp_path, attempt=1) == []
