"""Benchmark: tokens/s and MFU of scripts/train/train.py, per layout that fits this machine's world size.

Each layout is one `torchrun --standalone` run of the recipe as a reader would type it; the figures are the last
logging window's (after compilation and warm-up). MFU is against the datasheet's dense peak of the GPUs in the
training dtype (scripts/train/hardware.py: the convention torchtitan, nanoGPT and papers use), and beside it
against the matmul rate train.py measures at its start on the same device; a CPU has no datasheet row, so there
the measured rate is the only one. On a GPU machine the headline is the recipe's GPU defaults (the preset `small`,
sequence length 1024, bf16, torch.compile) on one GPU; with several GPUs the layouts of all of them follow. On CPUs: the recipe's tiny CPU model, each layout on --world ranks (2 by default), against one
process. Beside them, at world size 1, the recipe against the plain loop of the same model, optimizer, clipping and
data (`plain_loop`: no mesh, no FSDP2, no collective), in pairs run alternately: what one process pays for the
recipe. Asserts nothing about speed (a loaded machine is not a failure); prints a table and, last, one line per
row for docs/measurements.md.

    python benchmarks/train_bench.py                     # ./cookbook bench train
    python benchmarks/train_bench.py --world 4 --steps 30
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1] / "scripts" / "train"


def layouts(world: int) -> list[tuple[str, int, list[str]]]:
    """(name, ranks, flags) of every layout `world` ranks can take, one process first: named as train.py's first
    line names it, and written as its flags, both by the recipe's job spec (job.ParallelDims.describe, job.argv)."""
    from job import ParallelDims, argv

    rows = [(ParallelDims(), {})]
    if world >= 2:
        rows += [(ParallelDims(dp_replicate=world), {}), (ParallelDims(dp_shard=world), {}),
                 (ParallelDims(tp=world), {}), (ParallelDims(pp=world), {"accum": 2 * world})]
    if world >= 4 and world % 2 == 0:
        rows += [(ParallelDims(dp_replicate=2, dp_shard=world // 2), {}), (ParallelDims(dp_shard=world // 2, tp=2), {})]
    return [(dims.describe(), dims.world, argv({"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard,
                                                  "tp": dims.tp, "pp": dims.pp, **extra})) for dims, extra in rows]


def run(name: str, ranks: int, flags: list[str], common: list[str], env: dict, timeout: float,
        recipe: Path = RECIPE) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               str(recipe / "train.py"), *common, *flags]
    print(f"--- {name}: {' '.join(command[3:])}", flush=True)
    started = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    lines = proc.stdout.splitlines()
    for line in lines:
        if line.startswith(("training", "step")):
            print("    " + line, flush=True)
    summary = [json.loads(line[len("summary: "):]) for line in lines if line.startswith("summary: ")]
    if proc.returncode != 0 or not summary:
        print(proc.stdout[-2000:] + proc.stderr[-4000:], flush=True)
        return {"layout": name, "ranks": ranks, "error": f"exit status {proc.returncode}"}
    return {"layout": name, "ranks": ranks, "wall_s": time.perf_counter() - started, **summary[0]}


def plain_loop(args, timed) -> None:
    """The recipe's model, optimizer, clipping and data in the simplest loop one process can run: no process group,
    no mesh, no FSDP2, no collective, a log line's `.item()` on train.py's log steps. The same shape, defaults,
    initial weights, AdamW groups and schedule, gradient clipping and batches as train.py with `args` (parsed by
    train.py's own parse_args) on one process. `timed(steps)` runs the loop (and times it)."""
    import torch

    import data
    import train
    from ac import apply_ac, apply_compile
    from model import Llama, cross_entropy

    if args.accum != 1:
        raise ValueError(f"the plain loop takes one micro-batch a step: leave --accum {args.accum} out of --extra")
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    with torch.device("meta"):
        model = Llama(args.model_config)
    train.apply_experts(model, args, None)       # --extra '--moe-experts E': the same experts, on this one process
    apply_ac(model, args.ac)                     # --extra '--ac ...' checkpoints the plain loop's blocks too
    if args.compile:
        apply_compile(model)
    model.to_empty(device=device)
    model.init_weights(args.seed)
    optimizer, scheduler = train.build_optimizer(model, args)
    paths = [Path(p) for p in args.data] if args.data else train.default_data()
    batches = iter(data.train_loader(paths, args.seq_len, args.batch, 0, 1, args.batch, args.seed))
    autocast = torch.autocast(device.type, dtype=train.DTYPES[args.dtype], enabled=args.dtype != "fp32")

    def steps():
        for step in range(1, args.steps + 1):
            x, y = (t.to(device, non_blocking=True) for t in next(batches))
            with autocast:
                loss = cross_entropy(model(x), y)
            (loss + train.balance_loss(model, args)).backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if step % args.log_every == 0 or step == args.steps or step == 1:      # train.py's log steps
                loss.item(), norm.item()

    timed(steps)                                   # the steps alone, as train.py's run_steps is timed


def one_process_run(kind: str, flags: list[str]) -> dict:
    """In this process, one run of train.py's steps on one rank ("recipe": its `run_steps`, in the process group of
    one that torchrun would make) or of `plain_loop` ("plain"): the CPU and wall seconds of the steps alone (not the
    start, the evaluation or the exit), and the tokens they trained."""
    import torch

    import train

    args = train.parse_args(flags)
    spent = {}

    def timed(steps, *call_args, **kwargs):
        cpu, wall = time.process_time(), time.perf_counter()
        try:
            return steps(*call_args, **kwargs)
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            spent.update(cpu_s=time.process_time() - cpu, wall_s=time.perf_counter() - wall)

    if kind == "plain":
        plain_loop(args, timed)
    else:
        import socket

        with socket.socket() as sock:                      # a free port for the one-rank group's store
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        run_steps = train.run_steps
        train.run_steps = lambda *call_args, **kwargs: timed(run_steps, *call_args, **kwargs)
        train.run_distributed(train.train, args)
    return {"kind": kind, "tokens": args.steps * args.batch * args.seq_len, **spent}


def one_process_tax(common: list[str], env: dict, repeats: int, recipe: Path) -> str:
    """train.py's steps on one process against `plain_loop` with the same flags, `repeats` pairs run alternately,
    each run a fresh process (`one_process_run`). On a CPU, with one thread each, the figure is tokens per CPU second
    of the steps: on a shared machine the wall clock measures the neighbours as much as the code (tokens per wall
    second are printed beside it). On a GPU, tokens per second. Returns the lines to print."""
    import torch

    gpu = env.get("CUDA_VISIBLE_DEVICES") != "" and torch.cuda.is_available()
    env = env if gpu else {**env, "OMP_NUM_THREADS": "1"}
    key = "wall_s" if gpu else "cpu_s"
    pairs, rows = [], []
    for i in range(repeats):
        got = {}
        for kind in ("recipe", "plain"):
            print(f"--- {kind}, one process, pair {i + 1}", flush=True)
            proc = subprocess.run([sys.executable, __file__, "--recipe", str(recipe), "--one-process", kind, *common],
                                  env=env, capture_output=True, text=True, timeout=1800)
            got[kind] = next((json.loads(line[len("result: "):]) for line in proc.stdout.splitlines()
                              if line.startswith("result: ")), None)
            if got[kind] is None:
                print(proc.stdout[-2000:] + proc.stderr[-4000:], flush=True)
        if None in got.values():
            continue
        rate = {k: {t: r["tokens"] / r[t] for t in ("cpu_s", "wall_s")} for k, r in got.items()}
        pairs.append({t: rate["recipe"][t] / rate["plain"][t] for t in ("cpu_s", "wall_s")})
        rows.append(f"  pair {i + 1}: recipe {rate['recipe'][key]:,.0f}, plain loop {rate['plain'][key]:,.0f} tokens "
                    f"per {'second' if gpu else 'CPU second'}: ratio {pairs[-1][key]:.3f} (per wall second "
                    f"{pairs[-1]['wall_s']:.3f})")
    if not pairs:
        return "one process against the plain loop: no pair finished"
    ratios = sorted(p[key] for p in pairs)
    return "\n".join([f"one process against the plain loop (no mesh, FSDP2 or collective; the same model, AdamW, "
                      f"clipping and data), the steps alone{'' if gpu else ', one thread each'}:", *rows,
                      f"  recipe / plain loop: median {statistics.median(ratios):.3f} (range {ratios[0]:.3f}-"
                      f"{ratios[-1]:.3f}) over {len(ratios)} pairs; per wall second, median "
                      f"{statistics.median(p['wall_s'] for p in pairs):.3f}"])


def main() -> None:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=gpus if gpus else 2, help="ranks for the parallel layouts "
                        "(default: every GPU, else 2 CPU processes)")
    parser.add_argument("--steps", type=int, default=60 if gpus else 20)
    parser.add_argument("--log-every", type=int, default=20 if gpus else 10)
    parser.add_argument("--batch-per-rank", type=int, default=None, help="sequences per data-parallel rank "
                        "(default: the recipe's, 16 on GPUs, 8 on CPUs)")
    parser.add_argument("--extra", default="", help="more train.py flags for every run, e.g. '--ac selective'")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of one-process runs: the recipe, then the "
                        "plain loop (side by side, alternating)")
    parser.add_argument("--recipe", type=Path, default=RECIPE, help="the recipe folder (default: scripts/train)")
    parser.add_argument("--one-process", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # a child: KIND FLAGS
    args = parser.parse_args()
    sys.path.insert(0, str(args.recipe))              # the recipe's modules: its job spec here, train.py in a child
    if args.one_process is not None:                  # one run of one kind, in a process of its own
        print("result: " + json.dumps(one_process_run(args.one_process[0], args.one_process[1:])), flush=True)
        return
    cores = os.cpu_count()
    print(f"{time.strftime('%Y-%m-%d', time.gmtime())}; torch {torch.__version__}, Python "
          f"{sys.version.split()[0]}, {cores} cores, "
          f"{torch.cuda.get_device_name(0) if gpus else 'no GPU'} x {gpus}; world {args.world}", flush=True)
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, XDG_CACHE_HOME=cache, PYTHONUNBUFFERED="1")
        if gpus and args.world > gpus:
            env["CUDA_VISIBLE_DEVICES"] = ""
        common = ["--steps", str(args.steps), "--log-every", str(args.log_every), *args.extra.split()]
        results = []
        tax = one_process_tax(common, env, args.repeats, args.recipe)
        for name, ranks, flags in layouts(args.world):
            if not gpus and ranks > cores:
                print(f"warning: {ranks} ranks on {cores} cores: the figures of '{name}' measure the scheduler too")
            batch = ["--batch", str(args.batch_per_rank * ranks)] if args.batch_per_rank else []
            if gpus and ranks == 1:
                name += " (1 GPU, preset small, seq 1024, bf16, compile)"
            results.append(run(name, ranks, flags + batch, common, env, timeout=1800, recipe=args.recipe))
    print(f"\n{'layout':<52} {'ranks':>5} {'tokens/s':>12} {'MFU':>7} {'of measured':>12} {'peak mem':>10} "
          f"{'matmul peak':>13}")
    for r in results:
        if "error" in r:
            print(f"{r['layout']:<52} {r['ranks']:>5} {r['error']}")
            continue
        print(f"{r['layout']:<52} {r['ranks']:>5} {r['tokens_per_s']:>12,.0f} {100 * r['mfu']:>6.1f}% "
              f"{100 * r['mfu_of_measured']:>11.1f}% {r['peak_memory_gib']:>7.2f} GiB "
              f"{r['matmul_peak_tflops']:>8.3g} TF/s")
    print(tax)
    sources = {r["peak_source"] for r in results if "error" not in r}
    print("MFU against: " + "; ".join(sorted(sources)))
    print("\nfor docs/measurements.md:")
    for r in results:
        if "error" not in r:
            print(f"| train.py {r['layout']} | {r['device']} x {r['ranks']} | {r['parameters'] / 1e6:.1f}M params "
                  f"| {r['tokens_per_s']:,.0f} tokens/s | MFU {100 * r['mfu']:.1f}% of {r['peak_tflops']:.4g} "
                  f"TFLOP/s ({r['peak_source']}); {100 * r['mfu_of_measured']:.1f}% of "
                  f"{r['matmul_peak_tflops']:.3g} TFLOP/s measured | torch {torch.__version__} |")


if __name__ == "__main__":
    main()
