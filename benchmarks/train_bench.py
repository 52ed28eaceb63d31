"""Benchmark: tokens/s and MFU of scripts/train/train.py, per layout that fits this machine's world size.

Each layout is one `torchrun --standalone` run of the recipe as a reader would type it; the figures are the last
logging window's (after compilation and warm-up). MFU is against the datasheet's dense peak of the GPUs in the
training dtype (scripts/train/hardware.py: the convention torchtitan, nanoGPT and papers use), and beside it
against the matmul rate train.py measures at its start on the same device; a CPU has no datasheet row, so there
the measured rate is the only one. On a GPU machine the headline is the recipe's GPU defaults (the preset `small`,
sequence length 1024, bf16, torch.compile) on one GPU; with several GPUs the layouts of all of them follow. On CPUs: the recipe's tiny CPU model, each layout on --world ranks (2 by default), against one
process. Asserts nothing about speed (a loaded machine is not a failure); prints a table and, last, one line per
row for docs/measurements.md.

    python benchmarks/train_bench.py                     # ./cookbook bench train
    python benchmarks/train_bench.py --world 4 --steps 30
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1] / "scripts" / "train"


def layouts(world: int) -> list[tuple[str, int, list[str]]]:
    """(name, ranks, flags) of every layout `world` ranks can take, one process first."""
    rows = [("one process", 1, [])]
    if world < 2:
        return rows
    rows += [(f"DDP {world}", world, ["--dp-replicate", str(world), "--dp-shard", "1"]),
             (f"FSDP2 {world}", world, []),
             (f"TP {world}", world, ["--tp", str(world)]),
             (f"pipeline {world} (1f1b)", world, ["--pp", str(world), "--accum", str(2 * world)])]
    if world >= 4 and world % 2 == 0:
        rows += [(f"HSDP 2x{world // 2}", world, ["--dp-replicate", "2", "--dp-shard", str(world // 2)]),
                 (f"FSDP2 {world // 2} x TP 2", world, ["--tp", "2"])]
    return rows


def run(name: str, ranks: int, flags: list[str], common: list[str], env: dict, timeout: float) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               str(RECIPE / "train.py"), *common, *flags]
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
    args = parser.parse_args()
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
        for name, ranks, flags in layouts(args.world):
            if not gpus and ranks > cores:
                print(f"warning: {ranks} ranks on {cores} cores: the figures of '{name}' measure the scheduler too")
            batch = ["--batch", str(args.batch_per_rank * ranks)] if args.batch_per_rank else []
            if gpus and ranks == 1:
                name += " (1 GPU, preset small, seq 1024, bf16, compile)"
            results.append(run(name, ranks, flags + batch, common, env, timeout=1800))
    print(f"\n{'layout':<52} {'ranks':>5} {'tokens/s':>12} {'MFU':>7} {'of measured':>12} {'peak mem':>10} "
          f"{'matmul peak':>13}")
    for r in results:
        if "error" in r:
            print(f"{r['layout']:<52} {r['ranks']:>5} {r['error']}")
            continue
        print(f"{r['layout']:<52} {r['ranks']:>5} {r['tokens_per_s']:>12,.0f} {100 * r['mfu']:>6.1f}% "
              f"{100 * r['mfu_of_measured']:>11.1f}% {r['peak_memory_gib']:>7.2f} GiB "
              f"{r['matmul_peak_tflops']:>8.3g} TF/s")
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
