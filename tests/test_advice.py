"""helpers.measure.advice: one verdict for every comparison of a measurement with a piece of advice; the appendix
"Common advice, measured" has one anchored section per piece of advice, and every link to it lands on one."""
from __future__ import annotations

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
    elsewhere = judge("s", "a", "x", "m", 3.0, 5, 7, applicable=False, reason="the claim is for 8 GPUs")
    assert elsewhere.verdict == "not comparable here: the claim is for 8 GPUs"
    assert "holds: within the claimed 15-20" == judge("s", "a", "x", "m", 17, 15, 20).verdict


def test_judge_finding_says_what_was_found():
    assert judge_finding("s", "a", "x", "m", True, "it ran").verdict == "holds: it ran"
    assert judge_finding("s", "a", "x", "m", False, "it failed").answer == "does not hold"
    assert judge_finding("s", "a", "x", "m", True, "", applicable=False, reason="one node").verdict == \
        "not comparable here: one node"


def test_the_summary_has_one_line_per_claim_and_counts_the_answers():
    rows = [judge("a", "x", "s", "m", 7, 5, 10), judge("a", "y", "s", "m", 1, 5, 10),
            judge_finding("b", "z", "s", "m", True, "", applicable=False, reason="r")]
    table = advice.summary_table(rows)
    assert len(table.splitlines()) == 1 + len(rows)
    assert advice.answer_counts(rows) == {"holds": 1, "does not hold": 1, "inconclusive": 0,
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
