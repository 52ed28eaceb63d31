"""Run notebooks (every cell), the tests or the launcher benchmark within a time budget, saving after each step.

Why this exists: a lent GPU machine runs short calls (10 minutes a command, 15 minutes of device time a session),
a call brings back at most 8 files, and a command stopped at its limit brings back only what it had already
written. A notebook that hangs on NCCL must not take the other notebooks' results with it, and a first run on a new
machine should list every failing cell, not stop at the first. So each notebook runs in a child process with what is
left of the budget (its whole process tree, kernel and workers included, is stopped at the deadline), every cell
runs even after an error, and after each step the output folder's one file, `budget_run.tar.gz`, is rewritten
(whole, or not at all). It holds, under `budget_run/`:
  summary.json    one record per step: status, seconds, failing cells, headline figures
  figures.md      table rows for docs/measurements.md: date, device, torch, command, the headline figures
  {mode}/         the executed notebooks (NAME.smoke.ipynb / NAME.full.ipynb) and the output of each one's run (.log);
                  a notebook stopped at the budget is there as far as it got, even before its first cell, its status
                  in its metadata (`budget_run`) and the cell it stopped at in summary.json
  tests.N.log, bench.N.log   the output of the tests or the benchmark, N the step's number in summary.json
Several commands with the same --out add to one archive. The console gets each step's line as it ends.
Nothing here is GPU-specific: on a CPU it runs the same way (that is how it is tested).

usage: python -m tools.budget_run {smoke|full} [NAME ...] [--budget S] [--out DIR]
       python -m tools.budget_run {tests|bench} [--budget S] [--out DIR] [-- PYTEST OR BENCHMARK ARGS]
On the GPU machine, through the on-device.sh that .ci/gpu-stage stages (see docs/measurements.md):
  bash .gpu/on-device.sh python3 -m tools.budget_run smoke --budget 540
What comes back is committed in docs/gpu-runs/DATE/ (the archive, or its summary.json, figures.md and logs), beside
docs/measurements.md, which quotes its figures.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from helpers.paths import NOTEBOOKS, REPO_ROOT

MODES = ("smoke", "full", "tests", "bench")
ARCHIVE = "budget_run.tar.gz"
FIGURES_HEADER = "| date | device | torch | command | figures |\n|---|---|---|---|---|\n"


def device_facts() -> dict:
    """Torch, CUDA, NCCL and device name, asked in a child so this process never holds a CUDA context."""
    code = ("import json, torch\n"
            "gpu = torch.cuda.is_available()\n"
            "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda,\n"
            "  'device': torch.cuda.get_device_name(0) if gpu else 'CPU only',\n"
            "  'gpus': torch.cuda.device_count() if gpu else 0,\n"
            "  'nccl': '.'.join(map(str, torch.cuda.nccl.version())) if gpu else None}))\n")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as exc:
        return {"torch": "?", "cuda": None, "device": f"unknown ({type(exc).__name__})", "gpus": 0, "nccl": None}


def execute_all_cells(path: Path, smoke: bool, out: Path) -> None:
    """Execute one notebook with papermill's parameters, every cell even after errors; write it to `out`.

    Runs in the child (`_one`); the cell timeout is the parent's business (it stops the whole tree). The notebook is
    written before the kernel starts and again after each cell, so a child killed outright still leaves what ran;
    stopped by SIGTERM at the budget, it writes what ran so far, the cell that was running included.
    """
    import signal

    import nbformat
    from nbclient import NotebookClient
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    nb = parameterize_notebook(load_notebook_node(str(path)), {"SMOKE": smoke}, kernel_name="python3")
    client = NotebookClient(nb, timeout=None, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(path.parent)}},
                            on_cell_executed=lambda **_: write_notebook(nb, out))

    def stopped(signum, frame):
        write_notebook(nb, out)
        raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, stopped)
    write_notebook(nb, out)
    try:
        client.execute()
    finally:
        write_notebook(nb, out)


def write_notebook(nb: dict, out: Path) -> None:
    """Replace `out` whole: a process stopped while writing leaves the previous version, never half a file."""
    partial = out.with_name(f".{out.name}.partial")
    partial.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    os.replace(partial, out)


def failing_cells(notebook: dict, ended_early: str | None = None) -> list[dict]:
    """Each error output, and, for a notebook whose run ended before its last cell (`ended_early` says why: "the
    budget ran out"), the cell it ended at: the cell's index and id, what went wrong.

    Cells run in order, so the cell a stop interrupted is the first code cell that had not finished: running (the
    kernel had begun it) or not yet begun (the kernel still starting, or between two cells)."""
    found = []
    finished_one = False
    for index, cell in enumerate(notebook.get("cells", [])):
        timing = cell.get("metadata", {}).get("execution", {})
        if ended_early and cell.get("cell_type") == "code" and "shell.execute_reply" not in timing:
            where = ("still running" if "iopub.execute_input" in timing else
                     "not begun" if finished_one else "not begun, the notebook's first cell,")
            found.append({"cell": index, "id": cell.get("id"), "ename": "Stopped",
                          "evalue": f"{where} when {ended_early}"})
            ended_early = None
        finished_one = finished_one or "shell.execute_reply" in timing
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                found.append({"cell": index, "id": cell.get("id"), "ename": output["ename"],
                              "evalue": output["evalue"][:400].replace("\n", " ")})
    return found


class Budget:
    """The seconds a command may still take. Asked before each step and, while a step runs, every `POLL_S`; the
    tests hand in a budget that runs out at an event (a cell has begun) rather than at a time, which no machine's
    speed can move."""

    POLL_S = 0.25

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def run_bounded(argv: list[str], budget: Budget, log: Path | None = None) -> tuple[str, float]:
    """Run a child until it ends or the budget runs out; then stop it and everything below it. Returns (status,
    seconds)."""
    from helpers.launcher.sessions import stop_sessions

    start, given = time.monotonic(), budget.left()
    stream = open(log, "w") if log else subprocess.DEVNULL
    try:
        child = subprocess.Popen(argv, stdout=stream, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                 start_new_session=True)
        while (left := budget.left()) > 0:
            try:
                rc = child.wait(timeout=min(Budget.POLL_S, left))
                status = "ran" if rc == 0 else f"exit {rc}"
                break
            except subprocess.TimeoutExpired:
                pass
        else:
            stop_sessions([child.pid], lambda pid, t: _waited(child, t), grace=5.0)
            status = f"stopped at the budget ({given:.0f} s)"
    finally:
        if log:
            stream.close()
    return status, time.monotonic() - start


def _waited(child: subprocess.Popen, timeout: float) -> bool:
    try:
        child.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


class Session:
    """What one command has done so far, kept in a working folder and written to `out` as one archive after each
    step. An archive already in `out` (an earlier command's) is unpacked first, so its records are kept."""

    def __init__(self, out: Path, mode: str, command: str):
        self.out, self.mode, self.command = out, mode, command
        out.mkdir(parents=True, exist_ok=True)
        self.facts = device_facts()
        self.work = Path(tempfile.mkdtemp(prefix="budget-run-")) / "budget_run"
        if (out / ARCHIVE).exists():
            with tarfile.open(out / ARCHIVE) as tar:
                tar.extractall(self.work.parent, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        self.executed = self.work / mode  # the notebook modes' executed notebooks and logs
        self.work.mkdir(parents=True, exist_ok=True)
        summary = self.work / "summary.json"
        self.records = json.loads(summary.read_text()) if summary.exists() else []

    def record(self, step: str, status: str, seconds: float, cells: list | None = None,
               figures: list | None = None, tests: list | None = None) -> None:
        """Add a step's record and its figures row, print them, and rewrite the archive. `tests`: the failed
        tests' lines ("FAILED tests/x.py::t"), for a tests step."""
        self.records.append({"mode": self.mode, "step": step, "status": status, "seconds": round(seconds, 1),
                             "failing_cells": cells or [], "failing_tests": tests or [], "figures": figures or [],
                             **self.facts})
        (self.work / "summary.json").write_text(json.dumps(self.records, indent=1))
        shown = "; ".join(f"{f['name']} = {f['value']:.4g} {f['unit']}".rstrip() for f in figures or [])
        if cells:
            shown = (shown + "; " if shown else "") + f"{len(cells)} failing cells"
        figures_md = self.work / "figures.md"
        if not figures_md.exists():
            figures_md.write_text(FIGURES_HEADER)
        device = f"{self.facts['gpus']}x {self.facts['device']}" if self.facts["gpus"] else self.facts["device"]
        torch_version = self.facts["torch"] + (f", CUDA {self.facts['cuda']}, NCCL {self.facts['nccl']}"
                                               if self.facts["gpus"] else "")
        with figures_md.open("a") as f:
            f.write(f"| {datetime.date.today()} | {device} | {torch_version} | `{self.command} {step}` | "
                    f"{step}: {status}, {seconds:.0f} s{'; ' + shown if shown else ''} |\n")
        self.archive()
        print(f"{step}: {status}, {seconds:.1f} s{'; ' + shown if shown else ''}", flush=True)
        for cell in cells or []:
            print(f"   cell {cell['cell']} ({cell['id']}): {cell['ename']}: {cell['evalue'][:200]}", flush=True)
        for test in tests or []:
            print(f"   {test}", flush=True)

    def archive(self) -> None:
        """Rewrite `out`'s one file; a command stopped while writing leaves the previous archive whole."""
        partial = self.out / f".{ARCHIVE}.partial"
        with tarfile.open(partial, "w:gz") as tar:
            tar.add(self.work, arcname=self.work.name)
        os.replace(partial, self.out / ARCHIVE)


def run_notebooks(session: Session, paths: list[Path], budget: Budget) -> bool:
    """Each notebook in turn with the budget left; True when every one ran without a failing cell.

    Every notebook begun is in the archive, as far as it got, with its status in its metadata (`budget_run`): one
    stopped before its first cell, by the budget or a child that died early, is the notebook as it was given."""
    from helpers.measure.headline import headlines_of

    ok = True
    for path in paths:
        if budget.left() < 10:
            session.record(path.stem, "not started (budget spent)", 0.0)
            ok = False
            continue
        session.executed.mkdir(exist_ok=True)
        out = session.executed / f"{path.stem}.{session.mode}.ipynb"
        out.unlink(missing_ok=True)
        status, seconds = run_bounded([sys.executable, "-m", "tools.budget_run", "_one", str(path),
                                       session.mode, str(out)], budget, log=out.with_suffix(".log"))
        written = out.exists()
        executed = json.loads((out if written else path).read_text())
        if not written and status == "ran":
            status = "no executed notebook written"
        ended_early = None if status == "ran" else ("the budget ran out" if status.startswith("stopped")
                                                    else f"the run ended ({status})")
        cells = failing_cells(executed, ended_early)
        executed.setdefault("metadata", {})["budget_run"] = {
            "status": status, "seconds": round(seconds, 1),
            "stopped_at": next(({"cell": c["cell"], "id": c["id"], "why": c["evalue"]} for c in cells
                                if c["ename"] == "Stopped"), None)}
        write_notebook(executed, out)
        session.record(path.stem, status, seconds, cells, headlines_of(executed))
        ok = ok and status == "ran" and not cells
    return ok


def parse_arguments(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The options, and the mode's own arguments: notebook names, or what follows `--` for pytest or the benchmark
    (split off first, so that pytest's `-m EXPR` or `-k EXPR` never meets this parser)."""
    parser = argparse.ArgumentParser(prog="python -m tools.budget_run", description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("names", nargs="*", help="notebook name substrings (smoke, full)")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for this whole command (default 540)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    own, passed_on = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parser.parse_args(own)
    if args.names and args.mode in ("tests", "bench"):
        parser.error(f"{args.mode} takes its arguments after --, e.g. {args.mode} -- {' '.join(args.names)}")
    if passed_on and args.mode in ("smoke", "full"):
        parser.error(f"{args.mode} takes notebook names, not arguments after --")
    return args, args.names + passed_on


def failed_tests(pytest_output: str) -> list[tuple[str, str]]:
    """(outcome, test id) of each test that failed or errored, from pytest -v's per-test lines (xdist's
    "[gw0] [ 12%] FAILED tests/x.py::t" or plain "tests/x.py::t FAILED") and its closing summary alike."""
    found = re.findall(r"^(?:\[gw\d+\] (?:\[ *\d+%\] )?)?(FAILED|ERROR) (tests/\S+)", pytest_output, re.M)
    found += [(o, t) for t, o in re.findall(r"^(tests/\S+) (FAILED|ERROR)\b", pytest_output, re.M)]
    return found


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_one"]:  # the child that executes one notebook
        execute_all_cells(Path(argv[1]), argv[2] == "smoke", Path(argv[3]))
        return 0
    args, rest = parse_arguments(argv)
    budget = Budget(args.budget)
    session = Session(args.out, args.mode, f"python -m tools.budget_run {args.mode}")
    if args.mode in ("smoke", "full"):
        from tools.run_notebooks import notebook_paths

        paths = [p for p in notebook_paths() if not rest or any(n in p.name for n in rest)]
        if not paths:
            raise SystemExit(f"budget_run: no notebook in {NOTEBOOKS} matches {rest}")
        return 0 if run_notebooks(session, paths, budget) else 1
    if args.mode == "tests":
        pytest_args = rest or ["-m", "not browser and not notebook"]
        # -v: a line per test as it ends ("[gw2] FAILED tests/..."), so a run stopped at the budget, before pytest's
        # summary, still names the tests that failed (the 2026-11-28 GPU run lost four names that way)
        argv_child = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", *pytest_args]
        log = session.work / f"tests.{len(session.records) + 1}.log"
    else:
        argv_child = [sys.executable, str(REPO_ROOT / "benchmarks" / "launch_overhead.py"), *rest]
        log = session.work / f"bench.{len(session.records) + 1}.log"
    status, seconds = run_bounded(argv_child, budget, log=log)
    text = log.read_text() if log.exists() else ""
    tail = text.strip().splitlines()[-1:]
    session.record(" ".join(rest) or args.mode, status + (f" ({tail[0]})" if tail else ""), seconds,
                   tests=[f"{outcome} {test}" for outcome, test in dict.fromkeys(failed_tests(text))])
    return 0 if status == "ran" else 1


if __name__ == "__main__":
    sys.exit(main())
