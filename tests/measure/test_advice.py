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
    elsewhere = judge("s", "a", "x", "m", 3.0, 5, 7, missing=["8 GPU(s) (it has 0)"])
    assert elsewhere.verdict == "not comparable here: this machine lacks 8 GPU(s) (it has 0)"
    assert "holds: within the claimed 15-20" == judge("s", "a", "x", "m", 17, 15, 20).verdict


def test_judge_finding_says_what_was_found():
    assert judge_finding("s", "a", "x", "m", True, "it ran").verdict == "holds: it ran"
    assert judge_finding("s", "a", "x", "m", False, "it failed").answer == "does not hold"
    assert judge_finding("s", "a", "x", "m", None, "", missing=["2 nodes (this job runs on 1)"]).verdict == \
        "not comparable here: this machine lacks 2 nodes (this job runs on 1)"
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
BARE = {"gpus": 0, "gpu_names": [], "capability": None, "gpu_memory": 0, "nodes": 1, "infiniband": [],
        "numa_nodes": 1, "numactl": None, "cores": 2, "tcp_rmem": [4096, 131072, 6291456]}
BIG = {"gpus": 32, "gpu_names": ["NVIDIA A100-SXM4-80GB"] * 32, "capability": (8, 0), "gpu_memory": 85_899_345_920,
       "nodes": 4, "infiniband": ["mlx5_0", "mlx5_1"], "numa_nodes": 2, "numactl": "/usr/bin/numactl", "cores": 128,
       "tcp_rmem": [4096, 131072, 6291456]}


def test_missing_names_each_fact_the_machine_lacks_and_nothing_where_it_has_them():
    needs = dict(gpus=8, gpu_memory_gb=80, capability=(8, 0), nodes=2, infiniband=True, numa_nodes=2)
    assert advice.missing(BIG, **needs) == []
    lacks = advice.missing(BARE, **needs)
    assert [p.split(" (")[0] for p in lacks] == ["8 GPU(s)", "2 nodes", "an InfiniBand or RoCE device", "2 NUMA nodes"]
    small = {**BIG, "gpus": 1, "capability": (7, 0), "gpu_memory": 16e9}
    assert advice.missing(small, gpus=1, capability=(8, 0), gpu_memory_gb=80) == [
        "GPUs of 80 GB (its first has 16 GB)", "compute capability 8.0 or later (it has 7.0)"]


def test_machine_setting_reads_this_machine():
    facts = advice.machine_setting()
    assert set(facts) == set(BARE)
    assert facts["nodes"] >= 1 and facts["numa_nodes"] >= 1 and isinstance(facts["infiniband"], list)


def _appendix_code() -> list[str]:
    return ["".join(c["source"]) for c in json.loads(APPENDIX.read_text())["cells"] if c["cell_type"] == "code"]


def test_the_appendix_types_no_applicability():
    text = "\n".join(_appendix_code())
    assert "applicable=" not in text and "reason=" not in text


def _missing_calls(tree):
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and ast.unparse(node.func) ==
            "advice.missing"]


def test_every_setting_in_the_appendix_is_read_from_the_machine_and_opens_on_a_machine_that_has_it():
    """Each `advice.missing(M, ...)` the appendix asks, evaluated on the facts of a machine that has the setting
    (32 A100-80GB, 4 nodes, InfiniBand, 2 NUMA nodes) and of this bare one: the first measures, the second names."""
    calls = [call for code in _appendix_code() for call in _missing_calls(ast.parse(code))]
    assert len(calls) >= 15
    named = set()
    for call in calls:
        assert ast.unparse(call.args[0]) == "M", "the facts come from advice.machine_setting()"
        kwargs = {k.arg: eval(ast.unparse(k.value), {"N": 2, "n": 32, "max": max}) for k in call.keywords}
        assert advice.missing(BIG, **kwargs) == [], ast.unparse(call)
        named.update(p.split(" (")[0] for p in advice.missing(BARE, **kwargs))
    assert {"an InfiniBand or RoCE device", "2 NUMA nodes", "2 nodes", "8 GPU(s)", "32 GPU(s)"} <= named


def test_every_missing_list_guards_a_measurement_and_reaches_a_verdict():
    """A name bound to `advice.missing(...)` is the test of a branch that runs something (`if not X`, `None if X
    else ...`) and is passed on as a verdict's missing=, so the facts decide both what runs and what is said."""
    for code in _appendix_code():
        tree = ast.parse(code)
        names = {node.targets[0].id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 and isinstance(node.targets[0], ast.Name) and isinstance(node.value, (ast.Call, ast.BinOp))
                 and _missing_calls(node.value)}
        tests = {ast.unparse(node.test) for node in ast.walk(tree) if isinstance(node, (ast.If, ast.IfExp))}
        passed = " ".join(ast.unparse(k.value) for node in ast.walk(tree) if isinstance(node, ast.Call)
                          for k in node.keywords if k.arg == "missing")
        for name in names - {"gpu_lacks", "tf32_lacks"}:  # the precision runs' guard is the cell above theirs
            assert {name, f"not {name}"} & tests, f"{name} guards no measurement"
        for name in names:
            assert re.search(rf"\b{name}\b", passed) or name == "gpu_lacks", f"{name} reaches no verdict"


def test_on_a_machine_with_infiniband_the_same_cell_measures(monkeypatch):
    """The nccl-ib-disable cell run with faked facts (the launch stubbed: no GPUs here): with an InfiniBand
    device and 2 GPUs it launches the timing with and without NCCL_IB_DISABLE and judges what came back; on this
    bare machine it launches nothing and names the missing facts."""
    import statistics
    import types

    cell = next(code for code in _appendix_code() if '"nccl-ib-disable"' in code)
    for machine, latencies in ((BIG, {"0": [20e-6, 21e-6, 20e-6], "1": [35e-6, 36e-6, 34e-6]}), (BARE, None)):
        launched, rows = [], []

        def launch(fn, *args, env, **kwargs):
            launched.append(env["NCCL_IB_DISABLE"])
            return [latencies[env["NCCL_IB_DISABLE"]]]

        space = {"advice": advice, "median": statistics.median, "M": machine, "REPEATS": 3, "TIMEOUT": 60,
                 "run_distributed": None, "helpers": types.SimpleNamespace(launch=launch), "record": rows.append}
        exec(cell, space)
        (row,) = rows
        if latencies:
            assert launched == ["0", "1"] and row.answer == "does not hold" and "mlx5_0" in row.measured
        else:
            assert launched == [] and row.answer == "not comparable here" and "InfiniBand" in row.verdict
