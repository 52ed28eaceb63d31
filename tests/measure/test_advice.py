"""helpers.measure.advice: one verdict for every comparison of a measurement with a piece of advice; the appendix
"Common advice, measured" has one anchored section per piece of advice, and every link to it lands on one."""
from __future__ import annotations

import ast
import json
import math
import re

import pytest

from helpers.measure import advice
from helpers.measure.advice import claim_text, judge, judge_finding, verdict
from helpers.paths import NOTEBOOKS, REPO_ROOT

APPENDIX = NOTEBOOKS / "11_common_advice_measured.ipynb"
# The anchors the core notebooks link to (`11_common_advice_measured.ipynb#<slug>`): one section each.
SLUGS = (
    "pg-timeout-300s", "debug-detail-cost", "ring-vs-parameter-server", "backend-table", "gloo-on-gpus",
    "nccl-ib-disable", "tcp-rmem", "threads-numactl", "launch-replaced-by-torchrun", "loader-workers-pin-memory",
    "loader-prefetch-factor", "accumulation-throughput", "ddp-bucket-size", "delay-all-reduce", "lr-linear-scaling",
    "find-unused-memory", "fp16-halves-communication", "scaling-efficiency", "zero2-memory", "device-mesh-devices",
    "ddp-vs-fsdp-memory", "sharding-cuts-communication", "sharded-optimizer-stability", "oom-tune-sharding",
    "fsdp-is-data-and-model-parallel", "llama7b-needs-4-a100", "replaced-libraries", "amp-speedup", "tf32-speedup",
    "apex-o2-growth-interval", "cudnn-benchmark", "empty-cache", "cuda-amp-replaced", "async-parameter-server",
    "gradient-compression", "save-state-dict-replaced", "rng-state-one-key", "elastic-agent-snippet",
    "debug-with-dcgmi", "ntp-time-sync", "resume-within-seconds", "emergency-snapshot", "model-parallel-is-pippy",
    "hybrid-parallelism", "pipelined-loading", "node-rank-launch",
)


def test_claim_text():
    assert claim_text(2, 3, "x") == "2-3x" and claim_text(18, 18, "%") == "18%" and claim_text(1.5, None, "x") == \
        "1.5x or more"


def test_within_below_above_with_factors():
    assert verdict(7, 5, 10).startswith("within")
    assert verdict(17, 15, 20) == "within the claimed 15-20"
    below = verdict(0.5, 5, 10)
    assert below.startswith("below") and "10x under its low end" in below
    above = verdict(40, 5, 10)
    assert above.startswith("above") and "4x over its high end" in above
    assert verdict(10, 15, 20).startswith("below")
    assert "under it)" in verdict(9, 18, 18)


def test_slack_either_side_or_one_side():
    assert verdict(22, 15, 20, slack=3) == "within the claimed 15-20, given the tolerance ±3"
    assert verdict(13, 15, 20, slack=3).startswith("within")
    assert verdict(30, 15, 20, slack=3).startswith("above")
    assert verdict(11, 15, 20, slack=3).startswith("below")
    assert verdict(3.2, 2, 3, slack=(0, 0.3), unit="x").startswith("within")
    assert verdict(1.9, 2, 3, slack=(0, 0.3), unit="x").startswith("below")
    assert verdict(3.4, 2, 3, slack=(0, 0.3), unit="x").startswith("above")


def test_open_ended_not_measured_not_applicable():
    assert verdict(1.6, 1.5, None, unit="x") == "within the claimed 1.5x or more"
    assert verdict(100.0, 1.5, None).startswith("within")
    assert verdict(1.2, 1.5, None).startswith("below")
    assert verdict(None, 5, 10) == "not measured here"
    assert verdict(math.nan, 5, 10) == "not measured here"
    assert verdict(float("inf"), 5, 10) == "not measured here"
    assert verdict(0.1, 2, 3, applicable=False, reason="no unit") == "not comparable here: no unit"
    assert verdict(0.0, 5, 10) == "below the claimed 5-10"  # no factor from a zero


def test_a_spread_that_straddles_a_boundary_is_inconclusive():
    assert verdict(17, 15, 20, spread=(14, 19)).startswith("inconclusive")
    assert verdict(17, 15, 20, spread=(16, 19)) == "within the claimed 15-20"
    assert verdict(25, 15, 20, spread=(19, 30)).startswith("inconclusive")
    assert verdict(25, 15, 20, spread=(21, 30)).startswith("above")
    # the tolerance widens the claim before the spread is compared with it
    assert verdict(21, 15, 20, slack=3, spread=(20.5, 22.5)).startswith("within")
    assert verdict(1.6, 1.5, None, spread=(1.4, 1.8)).startswith("inconclusive")


def test_a_claim_for_another_setting_is_not_comparable_with_its_reason():
    text = verdict(3.0, 5, 7, applicable=False, reason="claimed on 8 GPUs with NVLink; this machine: 2 CPU cores")
    assert text.startswith("not comparable here") and "8 GPUs" in text


def test_the_median_interval_contains_the_median_and_narrows_with_more_samples():
    import random
    import statistics

    from helpers.measure.advice import median_interval

    rng = random.Random(1)
    few = [rng.gauss(10, 1) for _ in range(7)]
    many = few + [rng.gauss(10, 1) for _ in range(200)]
    lo_few, hi_few = median_interval(few)
    lo_many, hi_many = median_interval(many)
    assert lo_few <= statistics.median(few) <= hi_few
    assert hi_many - lo_many < hi_few - lo_few
    assert median_interval([3.0, 1.0]) == (1.0, 3.0)


@pytest.mark.parametrize("placement, answer", [
    ((7, 5, 10), "holds"), ((0.5, 5, 10), "does not hold"), ((40, 5, 10), "does not hold"),
    ((None, 5, 10), "not comparable here")])
def test_judge_turns_a_placement_into_one_of_four_answers(placement, answer):
    row = judge("slug", "advice", "setting", "measured", *placement)
    assert row.answer == answer and row.verdict.startswith(answer)


def test_judge_keeps_inconclusive_and_not_comparable_with_their_reason():
    noisy = judge("s", "a", "x", "m", 17, 15, 20, spread=(14, 19))
    assert noisy.answer == "inconclusive" and "straddles" in noisy.verdict and noisy.spread == (14, 19)
    elsewhere = judge("s", "a", "x", "m", 3.0, 5, 7, missing=["8 GPU(s) (this machine has 0)"])
    assert elsewhere.verdict == "not comparable here: missing here: 8 GPU(s) (this machine has 0)"
    assert "holds: within the claimed 15-20" == judge("s", "a", "x", "m", 17, 15, 20).verdict


def test_judge_finding_says_what_was_found():
    assert judge_finding("s", "a", "x", "m", True, "it ran").verdict == "holds: it ran"
    assert judge_finding("s", "a", "x", "m", False, "it failed").answer == "does not hold"
    assert judge_finding("s", "a", "x", "m", None, "", missing=["ranks on 2 nodes (this launch spans 1)"]).verdict \
        == "not comparable here: missing here: ranks on 2 nodes (this launch spans 1)"
    with pytest.raises(ValueError):
        judge_finding("s", "a", "x", "m", None, "nothing ran, yet nothing is missing")


def test_the_summary_has_one_line_per_claim_and_counts_the_answers():
    rows = [judge("a", "x", "s", "m", 7, 5, 10), judge("a", "y", "s", "m", 1, 5, 10),
            judge_finding("b", "z", "s", "m", True, "", missing=["r"])]
    table = advice.summary_table(rows)
    assert len(table.splitlines()) == 1 + len(rows)
    assert advice.answer_counts(rows) == {"holds": 1, "exceeds the claim": 0, "does not hold": 1, "inconclusive": 0,
                                          "not comparable here": 1}
    assert str(rows[0]).splitlines()[-1] == "verdict:  holds: within the claimed 5-10"


def _anchors(notebook) -> list[str]:
    cells = json.loads(notebook.read_text())["cells"]
    return [a for c in cells if c["cell_type"] == "markdown" for a in re.findall(r'<a id="([^"]+)"></a>',
                                                                                 "".join(c["source"]))]


def test_the_appendix_has_one_anchored_section_per_piece_of_advice():
    anchors = _anchors(APPENDIX)
    assert sorted(anchors) == sorted(SLUGS), set(anchors) ^ set(SLUGS)


def test_every_section_judges_its_own_slug():
    """The code that follows a section's heading records a verdict under that section's slug."""
    cells = json.loads(APPENDIX.read_text())["cells"]
    current, judged = None, {}
    for c in cells:
        text = "".join(c["source"])
        found = re.findall(r'<a id="([^"]+)"></a>', text) if c["cell_type"] == "markdown" else []
        if found:
            current = found[0]
        elif c["cell_type"] == "code" and current:
            judged.setdefault(current, set()).update(re.findall(r'advice\.judge(?:_finding)?\(\s*"([^"]+)"', text))
    assert {slug: names for slug, names in judged.items() if names != {slug}} == {}
    assert set(judged) == set(SLUGS)


def test_every_link_to_the_appendix_lands_on_an_anchor():
    anchors = set(_anchors(APPENDIX))
    texts = [p for p in list(NOTEBOOKS.glob("*.ipynb")) + list((REPO_ROOT / "docs").glob("*.md"))
             + [REPO_ROOT / "README.md"] if p.exists()]
    broken = [f"{p.name}: #{slug}" for p in texts
              for slug in re.findall(r"11_common_advice_measured\.ipynb#([\w-]+)", p.read_text()) if slug not in anchors]
    assert not broken, broken


def test_a_broken_link_would_be_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("see [here](11_common_advice_measured.ipynb#no-such-slug)")
    assert re.findall(r"11_common_advice_measured\.ipynb#([\w-]+)", page.read_text()) == ["no-such-slug"]
    assert "no-such-slug" not in set(_anchors(APPENDIX))


def test_the_figure_shows_the_rows_with_a_number_and_a_positive_edge():
    import matplotlib

    matplotlib.use("Agg")
    from helpers.plots.advice import measured_against_claims

    rows = [judge("a", "a range", "s", "m", 7, 5, 10, spread=(6, 8)), judge("b", "at most", "s", "m", 3.5, 0, 1.1),
            judge("c", "a negative gain", "s", "m", -5, 0, None), judge("d", "not run", "s", "m", None, 1, 2)]
    labels = [t.get_text() for t in measured_against_claims(rows).axes[0].get_yticklabels()]
    assert labels == ["a: a range", "b: at most"]


def test_an_effect_larger_than_claimed_in_the_claimed_direction_exceeds_the_claim():
    assert verdict(7, 2, 3, unit="x", better="higher").startswith("beyond the claimed 2-3x (2.33x its high end)")
    assert judge("s", "a", "x", "m", 7, 2, 3, unit="x", better="higher").answer == "exceeds the claim"
    assert judge("s", "a", "x", "m", 7, 2, 3, unit="x").answer == "does not hold"  # no direction: outside is outside
    assert judge("s", "a", "x", "m", 1.5, 2, 3, better="higher").answer == "does not hold"  # short of it
    assert judge("s", "a", "x", "m", 0.5, 1, 3, better="lower").answer == "exceeds the claim"
    assert judge("s", "a", "x", "m", 5, 1, 3, better="lower").answer == "does not hold"
    # noise across the far edge, in the promised direction, leaves 'holds'; across the near edge it is inconclusive
    assert judge("s", "a", "x", "m", 2.9, 2, 3, spread=(2.5, 3.5), better="higher").answer == "holds"
    assert judge("s", "a", "x", "m", 2.1, 2, 3, spread=(1.5, 2.5), better="higher").answer == "inconclusive"
    with pytest.raises(ValueError):
        verdict(1, 0, 1, better="up")


def test_judge_takes_the_missing_facts_never_a_typed_applicable():
    with pytest.raises(TypeError):
        judge("s", "a", "x", "m", 3.0, 5, 7, applicable=False, reason="typed")
    with pytest.raises(TypeError):
        judge_finding("s", "a", "x", "m", True, "why", applicable=False)


# A machine with nothing the claims' settings ask for, and one with all of it: the same facts `machine_setting` reads.
BARE = {"gpus": 0, "gpu_names": [], "capability": None, "gpu_memory": 0, "allocated_nodes": 1, "infiniband": [],
        "numa_nodes": 1, "numactl": None, "cores": 2, "host_memory": 24 * advice.GIB,
        "tcp_rmem": [4096, 131072, 6291456]}
BIG = {"gpus": 32, "gpu_names": ["NVIDIA A100-SXM4-80GB"] * 32, "capability": (8, 0), "gpu_memory": 80 * advice.GIB,
       "allocated_nodes": 4, "infiniband": ["mlx5_0", "mlx5_1"], "numa_nodes": 2, "numactl": "/usr/bin/numactl",
       "cores": 128, "host_memory": 1024 * advice.GIB, "tcp_rmem": [4096, 131072, 6291456]}
# 8 GPUs of more memory than the claims' A100-80GB (an H200 has about 140 GiB), and 8 of less (an A100-40GB)
H200 = {**BIG, "gpus": 8, "gpu_names": ["NVIDIA H200"] * 8, "capability": (9, 0), "gpu_memory": 150_000_000_000}
A100_40GB = {**BIG, "gpus": 8, "gpu_names": ["NVIDIA A100-SXM4-40GB"] * 8, "gpu_memory": 42_000_000_000}


def test_missing_names_each_fact_the_machine_lacks_and_nothing_where_it_has_them():
    needs = dict(gpus=8, gpu_memory=80 * advice.GIB, capability=(8, 0), infiniband=True, numa_nodes=2)
    assert advice.missing(BIG, **needs) == []
    lacks = advice.missing(BARE, **needs)
    assert [p.split(" (")[0] for p in lacks] == ["8 GPU(s)", "an InfiniBand or RoCE device", "2 NUMA nodes"]
    small = {**BIG, "gpus": 1, "capability": (7, 0), "gpu_memory": 16 * advice.GIB}
    assert advice.missing(small, gpus=1, capability=(8, 0), gpu_memory=80 * advice.GIB) == [
        "GPUs of 80 GiB (this machine's first has 16 GiB)", "compute capability 8.0 or later (this machine's is 7.0)"]


def test_a_claim_about_80_gib_gpus_is_judged_at_80_gib_not_on_a_larger_gpu():
    """A GPU larger than the claim's is the claim's setting only for a run held to the claim's memory."""
    claim = dict(gpus=4, gpu_memory=80 * advice.GIB)
    whole = advice.missing(H200, **claim)  # no run described: it could use the whole 140 GiB
    assert len(whole) == 1 and whole[0].startswith("a run held to 80 GiB a GPU") and "140 GiB" in whole[0]
    assert advice.missing(H200, advice.workload(memory=80 * advice.GIB), **claim) == []
    assert advice.missing(BIG, advice.workload(memory=BIG["gpu_memory"]), **claim) == []
    assert advice.missing(A100_40GB, advice.workload(memory=A100_40GB["gpu_memory"]), **claim)[0].startswith(
        "GPUs of 80 GiB")


def test_workload_facts_the_model_size_the_ranks_and_a_step_that_does_not_fit():
    resnet50 = ("ResNet-50", 25_557_032)
    tiny = advice.workload(params=85_000, ranks=2, hosts=["a", "a"])
    (lack,) = advice.missing(BIG, tiny, model=resnet50)
    assert lack.startswith("a model the size of ResNet-50 (25.6 M parameters") and "0.085 M" in lack
    assert advice.missing(BIG, advice.workload(params=25_300_000), model=resnet50) == []  # within 2x
    assert advice.missing(BIG, advice.workload(params=60_000_000), model=resnet50)       # a ResNet-152
    assert advice.missing(BIG, advice.workload(params=25e6), model=resnet50, ranks=8) == [
        "a run on 8 ranks (this one used None)"]
    assert advice.missing(BIG, tiny, ranks=2) == []
    fits = advice.workload(memory=12 * advice.GIB, peak=8 << 20)
    assert advice.missing(BIG, fits, out_of_memory=True)[0].startswith("a step that does not fit in memory")
    assert advice.missing(BIG, advice.workload(memory=1 << 20, peak=8 << 20), out_of_memory=True) == []


def test_nodes_are_those_a_launch_spans_never_the_allocation():
    """A 4-node allocation with every rank on one host is one node; two hosts are two, whatever was allocated."""
    one_host = advice.workload(ranks=8, hosts=["node-a"] * 8)
    (lack,) = advice.missing(BIG, one_host, nodes=2)
    assert lack == "ranks on 2 nodes (this launch spans 1; the job holds 4)"
    assert advice.missing(BIG, nodes=2)[0].startswith("ranks on 2 nodes (no launch across nodes")
    assert advice.missing(BARE, advice.workload(hosts=["node-a", "node-b"]), nodes=2) == []
    assert advice.workload(hosts=None)["nodes"] is None and advice.workload(hosts=["x", "y", "x"])["nodes"] == 2


def test_machine_setting_reads_this_machine():
    facts = advice.machine_setting()
    assert set(facts) == set(BARE)
    assert facts["allocated_nodes"] >= 1 and facts["numa_nodes"] >= 1 and isinstance(facts["infiniband"], list)
    assert facts["host_memory"] > 0


def _appendix_code() -> list[str]:
    return ["".join(c["source"]) for c in json.loads(APPENDIX.read_text())["cells"] if c["cell_type"] == "code"]


def test_the_appendix_types_no_applicability():
    text = "\n".join(_appendix_code())
    assert "applicable=" not in text and "reason=" not in text


def _missing_calls(tree):
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and ast.unparse(node.func) ==
            "advice.missing"]


def _constants() -> dict:
    """The appendix's upper-case constants that need no call to compute (RESNET50, A100_80GB, FEWER, ...)."""
    space = {"advice": advice}
    for code in _appendix_code():
        for node in ast.parse(code).body:
            if isinstance(node, ast.Assign) and not any(isinstance(n, ast.Call) for n in ast.walk(node.value)):
                try:
                    exec(ast.unparse(node), space)
                except NameError:
                    pass
    return {k: v for k, v in space.items() if k.isupper()}


def _workload_names() -> set[str]:
    """The names the appendix binds to `advice.workload(...)`: the runs whose facts a setting may be read from."""
    return {node.targets[0].id for code in _appendix_code() for node in ast.walk(ast.parse(code))
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "advice.workload"}


def test_every_setting_in_the_appendix_is_read_from_the_machine_and_the_run_and_opens_where_both_have_it():
    """Each `advice.missing(M, RUN, ...)` the appendix asks, evaluated on the facts of a machine that has the
    setting (32 A100-80GB, InfiniBand, 2 NUMA nodes) with a run that has it (the claim's model size, ranks, nodes,
    memory), and on this bare machine with a small one-node run: the first measures, the second names."""
    calls = [call for code in _appendix_code() for call in _missing_calls(ast.parse(code))]
    assert len(calls) >= 15
    space, workloads, named = {**_constants(), "N": 2, "n": 32, "max": max}, _workload_names(), set()
    small = advice.workload(params=85_000, ranks=2, hosts=["here", "here"], memory=24 * advice.GIB, peak=8 << 20)
    for call in calls:
        assert ast.unparse(call.args[0]) == "M", "the machine's facts come from advice.machine_setting()"
        if len(call.args) > 1:
            run = ast.unparse(call.args[1])
            assert run in workloads or run.startswith("advice.workload("), f"{run}: the run's facts come from workload"
        needs = {k.arg: eval(ast.unparse(k.value), space) for k in call.keywords}
        has_it = {"params": needs["model"][1] if "model" in needs else None, "ranks": needs.get("ranks"),
                  "nodes": needs.get("nodes"), "memory": needs.get("gpu_memory") or (1 if "out_of_memory" in needs
                                                                                      else None), "peak": 2}
        assert advice.missing(BIG, has_it, **needs) == [], ast.unparse(call)
        named.update(p.split(" (")[0] for p in advice.missing(BARE, small, **needs))
    assert {"an InfiniBand or RoCE device", "2 NUMA nodes", "ranks on 2 nodes", "8 GPU(s)", "32 GPU(s)",
            "a model the size of ResNet-50", "a model the size of ResNet-152", "a run on 8 ranks",
            "a step that does not fit in memory"} <= named


def test_every_missing_list_guards_a_measurement_and_reaches_a_verdict():
    """A name bound to `advice.missing(...)` is the test of a branch that runs something (`if not X`, `None if X
    else ...`) in its cell and is passed on as a verdict's missing= (there or in a later cell), so the facts decide
    both what runs and what is said."""
    passed = " ".join(ast.unparse(k.value) for code in _appendix_code() for node in ast.walk(ast.parse(code))
                      if isinstance(node, ast.Call) for k in node.keywords if k.arg == "missing")
    for code in _appendix_code():
        tree = ast.parse(code)
        names = {node.targets[0].id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 and isinstance(node.targets[0], ast.Name) and isinstance(node.value, (ast.Call, ast.BinOp))
                 and _missing_calls(node.value)}
        tests = {ast.unparse(node.test) for node in ast.walk(tree) if isinstance(node, (ast.If, ast.IfExp))}
        for name in names - {"tf32_lacks"}:  # the precision runs' guard (gpu_lacks) is the cell above tf32's
            assert {name, f"not {name}"} & tests, f"{name} guards no measurement"
        for name in names:
            assert re.search(rf"\b{name}\b", passed), f"{name} reaches no verdict"


def _cell(marker: str) -> str:
    return next(code for code in _appendix_code() if marker in code)


def _run_cell(code: str, space: dict) -> list:
    rows = []
    exec(code, {**space, "advice": advice, "record": rows.append})
    return rows


def test_on_a_machine_with_infiniband_the_same_cell_measures(monkeypatch):
    """The nccl-ib-disable cell run with faked facts (the launch stubbed: no GPUs here): with an InfiniBand
    device, 2 GPUs and ranks on two nodes it launches the timing with and without NCCL_IB_DISABLE and judges what
    came back; on this bare machine it launches nothing and names the missing facts."""
    import statistics
    import types

    cell = next(code for code in _appendix_code() if '"nccl-ib-disable"' in code)
    for machine, hosts, latencies in ((BIG, ["a", "b"], {"0": [20e-6, 21e-6, 20e-6], "1": [35e-6, 36e-6, 34e-6]}),
                                      (BIG, ["a", "a"], None), (BARE, ["a", "a"], None)):
        launched, rows = [], []

        def launch(fn, *args, env, **kwargs):
            launched.append(env["NCCL_IB_DISABLE"])
            return [latencies[env["NCCL_IB_DISABLE"]]]

        space = {"advice": advice, "median": statistics.median, "M": machine, "REPEATS": 3, "TIMEOUT": 60,
                 "LAUNCH": advice.workload(ranks=2, hosts=hosts),
                 "run_distributed": None, "helpers": types.SimpleNamespace(launch=launch), "record": rows.append}
        exec(cell, space)
        (row,) = rows
        if latencies:
            assert launched == ["0", "1"] and row.answer == "does not hold" and "mlx5_0" in row.measured
        else:
            assert launched == [] and row.answer == "not comparable here"
            assert ("InfiniBand" in row.verdict) == (machine is BARE) and "ranks on 2 nodes" in row.verdict


def _llama7b_space(machine, launch) -> dict:
    import types

    import torch

    from helpers.launcher.errors import WorkerError
    from helpers.measure.memory import zero_bytes_per_rank

    return {"M": machine, "torch": torch, "zero_bytes_per_rank": zero_bytes_per_rank, "LAUNCH_HOSTS": ["here"],
            "TIMEOUT": 60, "run_distributed": None,
            "helpers": types.SimpleNamespace(launch=launch, WorkerError=WorkerError)}


@pytest.mark.parametrize("machine", [BIG, H200], ids=["A100-80GB", "H200"])
def test_the_llama7b_claim_is_measured_at_80_gib_on_any_gpu_of_that_much(monkeypatch, machine):
    """The llama7b cell with faked facts (the launch stubbed): on 80 GiB GPUs, and on larger ones, it trains the
    step on three GPUs each held to 80 GiB, so a small step that fits is measured against the claim's GPU, not the
    machine's; a step out of memory there is the finding the other way."""
    from helpers.launcher.errors import RankFailure, WorkerError
    from helpers.paths import SCRIPTS

    monkeypatch.syspath_prepend(str(SCRIPTS / "train"))
    code = _cell('"llama7b-needs-4-a100"')
    for outcome in ("fits", "out of memory"):
        launched = []

        def launch(runner, fn, cfg, batch, cap, *, world_size, timeout):
            launched.append((world_size, cap, cfg.dim, batch))
            if outcome == "fits":
                return [{"peak": 30 * advice.GIB, "cap": cap}] * world_size
            raise WorkerError(RankFailure(0, "OutOfMemoryError", "CUDA out of memory. Tried to allocate 1 GiB"), [])

        (row,) = _run_cell(code, _llama7b_space(machine, launch))
        held = min(80 * advice.GIB, machine["gpu_memory"])
        assert launched == [(3, held, 4096, 4)], launched
        assert "held to 80 GiB each" in row.measured
        assert row.answer == ("does not hold" if outcome == "fits" else "holds"), row


def test_the_llama7b_claim_is_not_comparable_on_smaller_gpus(monkeypatch):
    from helpers.paths import SCRIPTS

    monkeypatch.syspath_prepend(str(SCRIPTS / "train"))
    launched = []
    (row,) = _run_cell(_cell('"llama7b-needs-4-a100"'),
                       _llama7b_space(A100_40GB, lambda *args, **kwargs: launched.append(args)))
    assert launched == [] and row.answer == "not comparable here" and "GPUs of 80 GiB" in row.verdict


@pytest.mark.parametrize("hosts, measures", [(["node-a", "node-a"], False), (["node-a", "node-b"], True)])
def test_clock_sync_is_measured_only_with_ranks_on_two_nodes_whatever_the_allocation(hosts, measures):
    """The ntp cell on a machine whose job holds 4 nodes (BIG): ranks that reported one host are one node (not
    comparable, nothing launched); ranks on two hosts are measured."""
    import statistics
    import types

    launched = []

    def launch(runner, fn, rounds, *, world_size, timeout):
        launched.append(world_size)
        return [[0.002, 0.001, 0.003]] * world_size

    space = {"M": BIG, "LAUNCH": advice.workload(ranks=len(hosts), hosts=hosts), "median": statistics.median,
             "REPEATS": 3, "N": len(hosts), "TIMEOUT": 60, "run_distributed": None,
             "helpers": types.SimpleNamespace(launch=launch)}
    (row,) = _run_cell(_cell('"ntp-time-sync"'), space)
    assert bool(launched) == measures
    if measures:
        assert row.answer in ("holds", "does not hold", "inconclusive") and "2.00 ms" in row.measured
    else:
        assert row.answer == "not comparable here" and "this launch spans 1; the job holds 4" in row.verdict
