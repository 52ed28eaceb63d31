# From the PyTorch distributed cookbook: the cells tagged 'script:train/selftest.py' in
#   notebooks/09_from_notebook_to_cluster.ipynb
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
"""The recipe's own proof: run it after every edit of this folder. A few small runs of train.py under torchrun on
CPU processes (gloo, the GPUs hidden), and what they must show:

- layouts: FSDP2, tensor parallel and a 2-stage pipeline, each on 2 processes, give one process's losses step by
  step and its evaluation loss, within 1e-5 relative (float32 sums taken in another order);
- exact resume: a run killed (SIGKILL, a lost node) after step 3 and started again resumes from its step-2
  checkpoint, then matches the uninterrupted run bit for bit (losses, final weights), and its metrics file holds
  each step once; the model the ranks gathered at the end (--export) is the one their last checkpoint holds;
- another layout: the FSDP2 run's step-2 checkpoint, taken up by the pipeline, trains on to the same losses.

    python selftest.py                    # prints each check and its time; exit status 0 when every one holds
    python selftest.py --keep st          # the runs' folders, logs and results.json stay in st/

It imports only this folder and torch; a layout an edit broke shows in its losses' second or third digit.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import checkpoint
import data as tokens
from job import argv

HERE = Path(checkpoint.__file__).resolve().parent      # this folder: train.py and the modules it imports
LOSS_RTOL = 1e-5          # a layout against one process: float32 rounding, grown by a few Adam steps
TINY = argv(dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=16, batch=8, steps=4, log_every=2,
                 eval_windows=32, dtype="fp32", compile=False))       # every run's shape: job.py's flags
RUN_TIMEOUT_S = 600


@dataclass
class Run:
    """One command in the work folder: train.py (or `args[0]` when it names a .py file) under torchrun with `nproc`
    ranks, or plain python (None), after the jobs in `after`; `before(workdir)` runs first; `metrics`: the
    --metrics file's stem (default: the job's name; two jobs may share one)."""
    name: str
    args: list[str]
    nproc: int | None = 1
    after: tuple[str, ...] = ()
    before: object = None
    env: dict = field(default_factory=dict)
    metrics: str | None = None


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    metrics: list[dict]

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def losses(self) -> dict[int, float]:
        return {m["step"]: m["loss"] for m in self.metrics if "loss" in m}

    def final_eval(self) -> float | None:
        return next((m["eval_loss"] for m in self.metrics if m.get("final")), None)


def run_jobs(workdir: Path, env: dict, jobs: list[Run], parallel: int = 2, data: list[str] = ()) -> dict:
    """Run `jobs` (`parallel` at a time, each after its dependencies) in `workdir`; their results by name. A
    torchrun job gets `--data` and the tiny shape first, then its own flags (which win)."""
    done = {job.name: threading.Event() for job in jobs}
    results: dict[str, Result] = {}

    def run(job: Run) -> None:
        try:
            for name in job.after:
                done[name].wait()
            if job.before:
                job.before(workdir)
            metrics = workdir / f"{job.metrics or job.name}.jsonl"
            named = bool(job.args) and job.args[0].endswith(".py")       # a script of its own (in workdir or here)
            script = job.args[0] if named else "train.py"
            script = str(workdir / script if (workdir / script).exists() else HERE / script)
            flags = job.args[1:] if named else job.args
            if job.nproc is None:
                command = [sys.executable, script, *flags]
            else:
                command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={job.nproc}", script, "--data", *data, *TINY,
                           "--metrics", str(metrics), *flags]
            proc = subprocess.run(command, cwd=workdir, env=env | job.env, capture_output=True, text=True,
                                  timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL)
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            results[job.name] = Result(proc.returncode, proc.stdout, proc.stderr, [json.loads(x) for x in lines])
        finally:
            done[job.name].set()

    with ThreadPoolExecutor(parallel) as pool:
        # submitted in order, each waiting only on earlier ones: the `parallel` threads never all wait
        for future in [pool.submit(run, job) for job in jobs]:
            future.result()
    return results


def copy_checkpoint(source: str, step: int, target: str):
    """A Run's `before`: one committed checkpoint of `source` into the --ckpt-dir `target`."""
    def copy(workdir: Path) -> None:
        shutil.copytree(workdir / source / f"step_{step:08d}", workdir / target / f"step_{step:08d}")
    return copy


def jobs() -> list[Run]:
    """The runs the checks read."""
    return [
        Run("one", [], 1),
        Run("fsdp", ["--ckpt-dir", "ck_fsdp", "--save-every", "2", "--eval-every", "2", "--async-save",
                     "--export", "live.pt"], 2),
        Run("tp", ["--tp", "2"], 2),
        Run("pp", ["--pp", "2", "--accum", "2"], 2),
        Run("crash", ["--ckpt-dir", "ck_crash", "--save-every", "2", "--crash-at", "3"], 2),
        Run("resumed", ["--ckpt-dir", "ck_crash", "--save-every", "2"], 2, after=("crash",), metrics="crash"),
        Run("resharded", ["--ckpt-dir", "ck_reshard", "--pp", "2", "--accum", "2"], 2, after=("fsdp",),
            before=copy_checkpoint("ck_fsdp", 2, "ck_reshard")),
    ]


def close(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and math.isclose(a, b, rel_tol=LOSS_RTOL)


def model_of(path: Path) -> dict:
    """The whole model of a committed checkpoint or an --export file, read by this process."""
    import torch

    return checkpoint.full_model_state(path)[1] if path.is_dir() else torch.load(path, weights_only=True)["model"]


def equal(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def checks(results: dict[str, Result], workdir: Path) -> list[tuple[str, bool, str]]:
    """(what, whether it holds, what was seen) for each property the runs must show."""
    r, one = results, results["one"]

    def layout(name):
        got, want = r[name].losses(), one.losses()
        far = {s: (got.get(s), want[s]) for s in want if not close(got.get(s), want[s])}
        return sorted(got) == sorted(want) == [1, 2, 3, 4] and not far and \
            close(r[name].final_eval(), one.final_eval()), f"(step: got, one process) {far}"

    def resumed():
        steps = [m["step"] for m in r["resumed"].metrics if "loss" in m]
        return r["crash"].returncode != 0 and "resumed from ck_crash/step_00000002" in r["resumed"].stdout and \
            steps == [1, 2, 3, 4], f"crash exit status {r['crash'].returncode}; the metrics' steps {steps}"

    def exact():
        ck = [workdir / d / "step_00000004" for d in ("ck_crash", "ck_fsdp")]
        return r["resumed"].losses() == r["fsdp"].losses() and r["resumed"].final_eval() == r["fsdp"].final_eval() \
            and equal(model_of(ck[0]), model_of(ck[1])), f"{r['resumed'].losses()} vs {r['fsdp'].losses()}"

    def resharded():
        got, want = r["resharded"].losses(), r["fsdp"].losses()
        return "resumed from ck_reshard/step_00000002" in r["resharded"].stdout and sorted(got) == [3, 4] and \
            all(close(got[s], want[s]) for s in got) and close(r["resharded"].final_eval(), r["fsdp"].final_eval()), \
            f"{got} vs {want}"

    wanted = [(f"{n}: the run ends cleanly", lambda n=n: (r[n].returncode == 0 and "terminate called" not in
                                                          r[n].output, r[n].output[-3000:]))
              for n in ("one", "fsdp", "tp", "pp", "resumed", "resharded")]
    wanted += [(f"{n} on 2 processes: one process's losses and evaluation loss within {LOSS_RTOL}",
                lambda n=n: layout(n)) for n in ("fsdp", "tp", "pp")]
    wanted += [("a run killed after step 3 resumes from its step-2 checkpoint; its metrics hold each step once",
                resumed),
               ("... and then matches the uninterrupted run bit for bit: losses, evaluation, final weights", exact),
               ("the model the ranks gathered at the end (--export) is their last checkpoint's",
                lambda: (equal(model_of(workdir / "live.pt"), model_of(workdir / "ck_fsdp" / "step_00000004")), "")),
               ("FSDP2's step-2 checkpoint, loaded by a 2-stage pipeline, trains on to the same losses", resharded)]
    found = []
    for what, check in wanted:
        try:
            ok, seen = check()
        except Exception as e:          # a run that failed left no file to read
            ok, seen = False, f"{type(e).__name__}: {e}"
        found.append((what, bool(ok), seen))
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="selftest.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", metavar="DIR", help="run in DIR and keep it (default: a temporary folder)")
    parser.add_argument("--data", nargs="+", help="token files (default: CPython's language reference as bytes)")
    parser.add_argument("--parallel", type=int, default=2, help="torchrun jobs at once (default 2)")
    args = parser.parse_args(argv)
    workdir = Path(args.keep or tempfile.mkdtemp(prefix="selftest_")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "XDG_CACHE_HOME": str(workdir / "cache")}
    data = [str(Path(d).resolve()) for d in args.data or [workdir / "tokens.bin"]]
    started = time.perf_counter()
    try:
        if not args.data:
            tokens.prepare([tokens.default_corpus_text()], workdir / "tokens.bin")
        print(f"selftest: {len(jobs())} runs of train.py under torchrun on CPU processes, {args.parallel} at a time, "
              f"in {workdir}", flush=True)
        results = run_jobs(workdir, env, jobs(), args.parallel, data)
        (workdir / "results.json").write_text(json.dumps({k: vars(v) for k, v in results.items()}))
        found = checks(results, workdir)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    for what, ok, seen in found:
        print(f"{'ok  ' if ok else 'FAIL'}  {what}" + ("" if ok else f"\n      {seen}"), flush=True)
    failed = sum(not ok for _, ok, _ in found)
    print(f"selftest: {len(found) - failed} of {len(found)} checks hold ({time.perf_counter() - started:.0f} s)")
    sys.exit(1 if failed else 0)

if __name__ == "__main__":
    main()
