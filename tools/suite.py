"""`./cookbook test`: pytest in a child process, beside busy processes if asked, then what the run cost.

usage: python -m tools.suite [--quick] [--under-load] [-- PYTEST ARGUMENTS]

After pytest's own summary it prints the wall time, the user and system CPU of every process the run started
(pytest, its xdist workers and all they started: torchrun and its ranks, notebook kernels, JupyterLab, Chromium),
the 15 tests that cost the most CPU (tools/suite_plugin.py says what it counts) and the 15 slowest;
with --quick, what the quick tier left out. The exit status is pytest's.

--quick        only the tests tests/conftest.py marks `quick` (pytest -m quick, joined to a -m of your own): what
               a developer runs after an edit, in a few minutes on 2 cores
--under-load   one busy process per core this process may use (a spinning loop) from before pytest starts until
               after it ends, however it ends (Ctrl-C too): the suite on a machine as loaded as a shared CI runner's

How the whole tree's CPU is counted: getrusage(RUSAGE_CHILDREN) holds the time of every child this process reaped,
and each child's holds that of the children it reaped, so a process counts once its parent's line up to here has
reaped it. An orphan (a kernel whose parent died, a process that left its session) would be re-parented to init
and counted nowhere; this process is a child subreaper (Linux's PR_SET_CHILD_SUBREAPER), so orphans come here
instead, and are reaped here as they end. Whatever is still running when pytest has ended is ended, reaped and
counted, and named (tests/conftest.py fails a test that leaves a process, so a name here is a leak it missed).
Not counted: work done by a process outside the tree on the suite's behalf (a system service), and, where
subreapers do not exist (not Linux), orphans. The busy processes' CPU is reported apart and left out of the suite's.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.suite_plugin import REPORT_VAR

SLOWEST = 15
QUICK_MARK = "quick"
# A busy process: a spinning loop that ignores the terminal's Ctrl-C (this process ends it, after pytest) and dies
# with this process (PR_SET_PDEATHSIG) should this one be killed outright.
BUSY_TAG = "cookbook-suite-busy"
BUSY_LOOP = f"""# {BUSY_TAG}
import ctypes, os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
if sys.platform.startswith("linux"):
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != {{parent}}:
        sys.exit()
while True:
    pass
"""


def parse_arguments(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This tool's options, and pytest's arguments (everything after `--`)."""
    own, passed_on = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m tools.suite", description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("--quick", action="store_true", help="only the tests marked quick (tests/conftest.py)")
    parser.add_argument("--under-load", action="store_true", help="a busy process per core beside the suite")
    return parser.parse_args(own), passed_on


def quick_selection(pytest_args: list[str]) -> list[str]:
    """pytest's arguments with `-m quick`, joined to the caller's own -m expression where there is one."""
    args = list(pytest_args)
    for i, arg in enumerate(args):
        if arg == "-m" and i + 1 < len(args):
            args[i + 1] = f"{QUICK_MARK} and ({args[i + 1]})"
            return args
        if arg.startswith("-m") and len(arg) > 2:
            args[i] = f"-m{QUICK_MARK} and ({arg[2:].lstrip('=')})"
            return args
    return args + ["-m", QUICK_MARK]


class Usage:
    """User and system CPU seconds."""

    def __init__(self, user: float = 0.0, system: float = 0.0):
        self.user, self.system = user, system

    @classmethod
    def of_children(cls) -> Usage:
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return cls(r.ru_utime, r.ru_stime)

    def __add__(self, other):
        return Usage(self.user + other.user, self.system + other.system)

    def __sub__(self, other):
        return Usage(self.user - other.user, self.system - other.system)

    @property
    def total(self) -> float:
        return self.user + self.system


class Reaper:
    """Reaps every child of this process as it ends: pytest, the busy processes, and the orphans adopted as a
    subreaper, whose number and CPU it keeps apart (they are in RUSAGE_CHILDREN as well)."""

    def __init__(self):
        self.busy: set[int] = set()
        self.busy_reaped = Usage()
        self.orphans, self.orphans_usage = 0, Usage()
        self.pytest_pid: int | None = None

    def reap(self, block: bool) -> tuple[int, int] | None:
        """One ended child, (pid, exit status), its CPU filed; None when none has ended or none is left."""
        try:
            pid, status, usage = os.wait4(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return None
        if pid == 0:
            return None
        spent = Usage(usage.ru_utime, usage.ru_stime)
        if pid in self.busy:
            self.busy_reaped += spent
        elif pid != self.pytest_pid:
            self.orphans += 1
            self.orphans_usage += spent
        return pid, status

    def wait_for(self, child: subprocess.Popen) -> int:
        """Wait until `child` ends, reaping whatever else ends meanwhile; its exit code."""
        self.pytest_pid = child.pid
        while (reaped := self.reap(block=True)) is not None:
            pid, status = reaped
            if pid == child.pid:
                code = os.waitstatus_to_exitcode(status)
                child.returncode = code if code >= 0 else 128 - code  # killed by a signal: a shell's status
                return child.returncode
        return child.wait()  # no child left: cannot happen while pytest runs

    def leftovers(self) -> list:
        """What still runs below this process besides the busy processes: what pytest's tree left."""
        import psutil

        me = psutil.Process()
        return [p for p in me.children(recursive=True)
                if p.pid not in self.busy and not any(a.pid in self.busy for a in _parents(p, me.pid))]

    def end_leftovers(self, grace: float = 5.0) -> list[str]:
        """End what pytest's tree left running (re-parented here as it lost its parents), reaping it; its names."""
        import psutil

        names = []
        for p in self.leftovers():
            try:
                names.append(f"{p.pid} {' '.join(p.cmdline())[:100]}")
            except psutil.Error:
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            deadline = time.monotonic() + grace
            for p in self.leftovers():
                try:
                    p.send_signal(sig)
                except psutil.Error:
                    pass
            while time.monotonic() < deadline:
                while self.reap(block=False) is not None:
                    pass
                if not [p for p in self.leftovers() if _running(p)]:
                    break
                time.sleep(0.05)
        while self.reap(block=False) is not None:
            pass
        return names


def _running(process) -> bool:
    try:
        return process.status() != "zombie"
    except Exception:  # noqa: BLE001 - gone meanwhile
        return False


def _parents(process, stop_at: int) -> list:
    try:
        return [p for p in process.parents() if p.pid != stop_at]
    except Exception:  # noqa: BLE001 - gone meanwhile
        return []


class BusyProcesses:
    """`count` spinning loops, children of this process, until `stop`."""

    def __init__(self, count: int, reaper: Reaper):
        self.reaper = reaper
        self.processes = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP.format(parent=os.getpid())],
                                           stdin=subprocess.DEVNULL) for _ in range(count)]
        reaper.busy.update(p.pid for p in self.processes)

    def stop(self) -> Usage:
        """Kill and reap them all; the CPU they used."""
        before = Usage.of_children()
        for p in self.processes:
            if p.returncode is None:
                try:
                    p.kill()
                except ProcessLookupError:
                    pass
        for p in self.processes:
            try:
                os.waitpid(p.pid, 0)
            except ChildProcessError:  # reaped earlier by the Reaper (it ended on its own)
                pass
            p.returncode = -signal.SIGKILL
        return Usage.of_children() - before + self.reaper.busy_reaped


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def run(quick: bool, under_load: bool, pytest_args: list[str]) -> int:
    from helpers.launcher.sessions import become_subreaper

    subreaper = become_subreaper()
    reaper = Reaper()
    args = quick_selection(pytest_args) if quick else list(pytest_args)
    report = Path(tempfile.mkstemp(prefix="cookbook-suite-", suffix=".json")[1])
    busy = None
    try:
        busy = BusyProcesses(cores(), reaper) if under_load else None
        before = Usage.of_children()
        start = time.monotonic()
        pytest = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "tools.suite_plugin", *args],
                                  env={**os.environ, REPORT_VAR: str(report)})
        with _interrupts_passed_to(pytest) as interrupts:
            code = reaper.wait_for(pytest)
            wall = time.monotonic() - start
            leftovers = reaper.end_leftovers()
        tree = Usage.of_children() - before - reaper.busy_reaped
        busy_usage, busy = (busy.stop() if busy else None), None
        print_cost(wall, tree, reaper, leftovers, subreaper, busy_usage, _read(report), quick)
    finally:
        if busy is not None:  # interrupted before pytest started, or an error of this tool's: they end all the same
            busy.stop()
        report.unlink(missing_ok=True)
    return 130 if interrupts and code == 0 else code


@contextlib.contextmanager
def _interrupts_passed_to(child: subprocess.Popen):
    """While pytest runs, Ctrl-C does not stop this process: the terminal sends it to pytest too (one process group),
    which ends its session and reports; a second Ctrl-C stops pytest (SIGTERM), a third kills it. A SIGTERM to this
    process (a CI job cancelled) is passed on to pytest. Either way this process goes on to end what is left and the
    busy processes. Yields the list of signals seen."""
    seen = []

    def interrupted(signum, frame):
        seen.append(signum)
        if child.returncode is None and (signum == signal.SIGTERM or len(seen) > 1):
            try:
                child.send_signal(signal.SIGKILL if len(seen) > 2 else signal.SIGTERM)
            except ProcessLookupError:
                pass

    previous = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield seen
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _read(report: Path) -> dict:
    try:
        return json.loads(report.read_text())
    except (OSError, ValueError):  # pytest ended before its plugin wrote (a crash, a kill)
        return {}


def print_cost(wall: float, tree: Usage, reaper: Reaper, leftovers: list[str], subreaper: bool,
               busy: Usage | None, report: dict, quick: bool) -> None:
    """The cost block printed after pytest's summary."""
    lines = ["", f"suite cost: {wall:.1f} s wall; CPU {tree.total:.1f} s (user {tree.user:.1f} s, system "
                 f"{tree.system:.1f} s) in pytest and every process below it, {tree.total / max(wall, 1e-9):.2f} x "
                 f"the wall on {cores()} cores"]
    if subreaper:
        lines.append(f"  of which orphans adopted and reaped here: {reaper.orphans} processes, "
                     f"{reaper.orphans_usage.total:.1f} s")
    else:
        lines.append("  orphans not counted: this system has no child subreapers")
    if leftovers:
        lines.append(f"  ended {len(leftovers)} processes still running after pytest (a leak the tests missed):")
        lines += [f"    {name}" for name in leftovers]
    if busy is not None:
        lines.append(f"  under load: {cores()} busy processes beside it, {busy.total:.1f} s of CPU, not counted above")
    lines += costliest_lines(report.get("cpu", {}), report.get("durations", {}), tree)
    durations = sorted(report.get("durations", {}).items(), key=lambda item: -item[1])[:SLOWEST]
    if durations:
        lines.append(f"the {len(durations)} slowest tests (setup, call and teardown):")
        lines += [f"  {seconds:7.1f} s  {test}" for test, seconds in durations]
    if quick:
        lines += left_out_lines(report.get("collected", {}), report.get("left_out", {}))
    print("\n".join(lines), flush=True)


def area_of(path: str) -> str:
    """tests/AREA of a test file's path (a file outside an area: the path itself)."""
    parts = path.split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else path


def costliest_lines(cpu: dict[str, list[float]], durations: dict[str, float], tree: Usage) -> list[str]:
    """The SLOWEST tests that cost the most CPU, with the share of the suite's CPU all tests' own CPU makes up."""
    if not cpu:
        return []
    spent = {test: Usage(*times) for test, times in cpu.items()}
    in_tests = sum((u for u in spent.values()), Usage())
    costliest = sorted(spent.items(), key=lambda item: -item[1].total)[:SLOWEST]
    by_area: dict[str, float] = {}
    for test, u in spent.items():
        by_area[area_of(test.split("::", 1)[0])] = by_area.get(area_of(test.split("::", 1)[0]), 0.0) + u.total
    lines = [f"  CPU in the tests themselves: {in_tests.total:.1f} s (user {in_tests.user:.1f} s, system "
             f"{in_tests.system:.1f} s) of {len(spent)} tests; the rest is pytest's collection, its workers' start "
             "and the orphans",
             "  by area: " + ", ".join(f"{a} {t:.1f} s" for a, t in sorted(by_area.items(), key=lambda i: -i[1])),
             f"the {len(costliest)} costliest tests by CPU (user+system, from its setup's start to its teardown's end, "
             "of the pytest process that ran it and every process below it, ended or still running: the fork-server "
             "and its workers, torchrun, notebook kernels, JupyterLab, Chromium; a fixture shared by several tests "
             "counts in the test that made it):"]
    lines += [f"  {u.total:7.1f} s CPU (user {u.user:6.1f}, system {u.system:5.1f}) {durations.get(test, 0.0):7.1f} s "
              f"wall  {test}" for test, u in costliest]
    return lines


def left_out_lines(collected: dict[str, int], left_out: dict[str, int]) -> list[str]:
    """What the quick tier did not run, by area (tests/AREA) and, in areas it ran in part, by file."""
    area = area_of
    total_left, total = sum(left_out.values()), sum(collected.values())
    lines = [f"--quick left out {total_left} of {total} tests (./cookbook test runs them all):"]
    areas = sorted({area(f) for f in collected})
    for a in areas:
        files = [f for f in collected if area(f) == a]
        left = sum(left_out.get(f, 0) for f in files)
        if not left:
            continue
        of = sum(collected[f] for f in files)
        lines.append(f"  {a}: {left} of {of}" + (" (the whole area)" if left == of else ""))
        if left < of:
            lines += [f"    {f}: {left_out[f]} of {collected[f]}" for f in sorted(files) if left_out.get(f)]
    return lines


def main(argv: list[str] | None = None) -> int:
    args, pytest_args = parse_arguments(sys.argv[1:] if argv is None else argv)
    return run(args.quick, args.under_load, pytest_args)


if __name__ == "__main__":
    sys.exit(main())
