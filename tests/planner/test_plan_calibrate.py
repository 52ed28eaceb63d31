"""plan.py --calibrate: the planner reads a short run of the recipe from its --metrics file and plans from what that
run reached.

A module fixture runs the recipe as a project would (scripts/train/ copied into an empty directory, a byte-level
token file made by `train.py prepare`, selftest.py's runner: torchrun, 2 CPU ranks, FSDP2) with a log line every 2
steps. The file it wrote is the run: its flags and model as the run had them, its tokens/s the median of the log
lines after the first, one compute factor that makes the planner predict exactly that tokens/s, and that factor as
a share of the device's peak carried to the GPU asked for. No assert rests on how fast this machine is.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys

import pytest

from helpers.paths import SCRIPTS

sys.path.insert(0, str(SCRIPTS / "train"))
import plan as P  # noqa: E402
from config import LlamaArgs  # noqa: E402

STEPS, EVERY = 6, 2


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """(the run's --metrics file, its Result): FSDP2 on 2 CPU ranks, the recipe's tiny shape, 6 steps."""
    root = tmp_path_factory.mktemp("project")
    for source in (SCRIPTS / "train").glob("*.py"):
        shutil.copy(source, root / source.name)
    import selftest      # its runner runs the copy's train.py (the copy is the work folder)

    env = {k: v for k, v in os.environ.items() if not k.startswith(("COOKBOOK_", "PYTHON"))}
    env |= {"CUDA_VISIBLE_DEVICES": "", "XDG_CACHE_HOME": str(root / "cache")}
    from pydoc_data.topics import topics

    (root / "corpus.txt").write_text("\n\n".join(topics[k] for k in sorted(topics)[:200]), encoding="utf-8")
    prepared = subprocess.run([sys.executable, "train.py", "prepare", "--text", "corpus.txt", "--out", "bytes.bin"],
                              cwd=root, env=env, capture_output=True, text=True, timeout=selftest.RUN_TIMEOUT_S)
    assert prepared.returncode == 0, prepared.stderr
    result = selftest.run_jobs(root, env, [selftest.Run("fsdp", ["--steps", str(STEPS), "--log-every", str(EVERY)],
                                                        2)], 1, ["bytes.bin"])["fsdp"]
    assert result.returncode == 0, result.output[-4000:]
    return root / "fsdp.jsonl", result


def test_the_log_is_the_run(logged):
    path, result = logged
    run, header = P.read_run_log(path)
    flags = header["flags"]
    assert (header["world"], header["device"]) == (2, "cpu") and flags["dp_shard"] == 2 and flags["steps"] == STEPS
    assert run.layout == P.Layout(dp_shard=2) and run.cfg == LlamaArgs(**header["model"])
    assert (run.cfg.dim, run.cfg.n_layers, run.cfg.n_heads, run.cfg.n_kv_heads) == (32, 2, 4, 2)
    assert run.train == P.Training(seq_len=16, batch_size=4, precision="fp32", checkpointing="none", compile=False,
                                   fused_rms_norm=False), "8 sequences a step over 2 FSDP2 ranks, fp32, eager"
    lines = [m for m in result.metrics if "tokens_per_s" in m]
    assert [m["step"] for m in lines] == [1, *range(EVERY, STEPS + 1, EVERY)], "the log lines carry their figures"
    assert run.tokens_per_s == statistics.median(m["tokens_per_s"] for m in lines[1:]) / 2, "per rank, start-up out"
    assert run.reserved_gib is None and run.allocated_gib is None, "a CPU's resident set is no allocator's peak"


def test_the_factor_makes_the_planner_predict_the_run(logged):
    run, header = P.read_run_log(logged[0])
    gpu = P.GPUS["H100-80GB"]
    rates, memory_factor, line = P.calibrated_rates(run, header, gpu)
    cpu = P.Rates(header["peak_flops"], header["peak_flops"], float("inf"), float("inf"), float("inf"), 0.0, 2)
    factor = P.calibrate(run, cpu)
    assert P.tokens_per_gpu(run.cfg, run.train, run.layout, cpu.scaled(factor, "")) == \
        pytest.approx(run.tokens_per_s, rel=1e-5), "the planner, at the solved rate, predicts the run"
    share = factor * cpu.matmul / header["peak_flops"]
    peak = P.datasheet_flops(gpu.device)[0]
    base = P.gpu_rates(gpu)
    assert rates.matmul == pytest.approx(share * peak)
    assert rates.float8 / rates.matmul == pytest.approx(base.float8 / base.matmul)
    assert rates.attention / base.attention == pytest.approx(rates.matmul / base.matmul), "every compute rate alike"
    assert (rates.memory, rates.intra, rates.inter) == (base.memory, base.intra, base.inter)
    assert memory_factor == 1.0 and "not corrected" in line and f"{share:.1%}" in line


def test_the_command_line_plans_from_the_log(logged):
    path = logged[0]
    argv = ["--model", "llama3-8b", "--gpus", "8", "--gpu", "H100-80GB", "--seq-len", "2048", "--top", "2"]
    plain, calibrated = (subprocess.run([sys.executable, str(SCRIPTS / "train" / "plan.py"), *argv, *extra],
                                        capture_output=True, text=True, timeout=600)
                         for extra in ([], ["--calibrate", str(path)]))
    assert plain.returncode == calibrated.returncode == 0, calibrated.stderr
    assert calibrated.stdout.startswith(f"calibrated from {path}: ") and "compute rates x" in calibrated.stdout
    assert "compute rates x" not in plain.stdout
    one_line = path.with_name("one_line.jsonl")
    one_line.write_text("\n".join(path.read_text().splitlines()[:2]) + "\n")     # the run's record, step 1
    refused = subprocess.run([sys.executable, str(SCRIPTS / "train" / "plan.py"), *argv, "--calibrate",
                              str(one_line)], capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and refused.stdout == "" and len(refused.stderr.splitlines()) == 1
    assert "two log lines or more" in refused.stderr, refused.stderr
