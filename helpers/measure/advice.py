"""Judging a piece of common advice against what this machine measured: one verdict, worded the same everywhere.

Why a module: the appendix "Common advice, measured" (notebooks/11_common_advice_measured.ipynb) prints, for each
piece of advice that circulates in tutorials and blog posts, the setting it assumes, what this machine measured
and a verdict that is computed, never typed. The rule that turns a measurement and its noise into a verdict, and
its wording, live here once:

- `verdict` places a measured figure against a claimed range [low, high] (open-ended where high is None, a
  tolerance for a figure quoted rounded): 'within', 'below', 'above'; 'inconclusive' where the interval the
  repeats allow (`spread`) straddles an edge of the claim; 'not comparable here' with the reason where the
  advice's setting (8 GPUs, InfiniBand, A100s) is not this machine's. Other measuring modules print it too.
- `judge` turns that placement into the appendix's five answers: 'holds' (within), 'exceeds the claim' (beyond
  the claimed range in the direction the advice promises: a 7x speed-up against a claimed 2-3x), 'does not hold'
  (below or above otherwise), 'inconclusive', 'not comparable here'. `judge_finding` does the same for advice
  whose test is a yes/no finding (an API this torch has, a warning it raises, an exception clause that ran), the
  finding computed by the caller from what it ran.
- `machine_setting()` reads the machine's facts a claim's setting is made of (GPUs, their kind and memory,
  InfiniBand or RoCE devices, NUMA nodes, host memory); `workload(...)` holds the facts of what a cell ran (the
  model's parameters, the ranks, the nodes its ranks really ran on, the memory a rank was held to, a step's
  peak). `missing(machine, run, gpus=8, model=("ResNet-50", ...), nodes=2, ...)` names each fact of either kind
  that is short. A verdict is 'not comparable here' only through that list (`judge(..., missing=...)`), so on a
  machine, and with a workload, that has the setting the same cell measures instead: read, never typed.
- `median_interval` is the noise of a median (a seeded bootstrap), shared by every module that times something.

A notebook never asserts a verdict's outcome (that would fix a noisy result in advance); it asserts properties of
what was measured.
"""
from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

ANSWERS = ("holds", "exceeds the claim", "does not hold", "inconclusive", "not comparable here")


def claim_text(low: float, high: float | None, unit: str = "") -> str:
    """The claim as printed: '18%', '2-3x', '1.5x or more' (high=None: open-ended)."""
    if high is None:
        return f"{low:g}{unit} or more"
    if high == low:
        return f"{low:g}{unit}"
    return f"{low:g}-{high:g}{unit}"


def median_interval(samples, confidence: float = 0.9, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A bootstrap interval of the median of `samples` (percentile method, seeded so a re-run prints the same).

    With fewer than 3 samples there is nothing to resample: the min-max range is returned.
    """
    values = [float(v) for v in samples]
    if not values:
        raise ValueError("no samples")
    if len(values) < 3:
        return min(values), max(values)
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1 - confidence) / 2
    return medians[int(tail * (resamples - 1))], medians[int((1 - tail) * (resamples - 1))]


def verdict(measured: float | None, low: float, high: float | None, *, slack: float | tuple[float, float] = 0.0,
            unit: str = "", applicable: bool = True, reason: str = "",
            spread: tuple[float, float] | None = None, better: str | None = None) -> str:
    """Where `measured` falls against the claimed range [low, high] (same unit; high=None: no upper end).

    slack: a tolerance either side, or (below, above), for claims quoted as a single rounded figure; a value
    inside the tolerance but outside the range says so. applicable=False: the claim's conditions do not hold on
    this machine (`reason` says why: the claim's setting beside this machine's), whatever was measured.
    spread: the interval the measurement's noise allows (same unit); where it straddles a boundary of the claim
    (widened by the tolerance) the verdict is 'inconclusive'. better: 'higher' or 'lower', the direction the advice
    promises (a speed-up, a saving: 'higher'); a figure past the claimed range on that side is 'beyond' the claim
    (the effect is larger than claimed), and noise that straddles only that far edge cannot turn 'within' into
    'inconclusive'. Returns a sentence starting with 'within', 'beyond', 'below', 'above', 'inconclusive',
    'not measured here' or 'not comparable here'.
    """
    if better not in (None, "higher", "lower"):
        raise ValueError(f"better must be 'higher', 'lower' or None, not {better!r}")
    if not applicable:
        return f"not comparable here: {reason or 'the claim was made for a setting this machine does not have'}"
    if measured is None or not math.isfinite(measured):
        return "not measured here"
    below, above = slack if isinstance(slack, tuple) else (slack, slack)
    claim = claim_text(low, high, unit)
    if spread is not None:
        lo, hi = sorted(float(v) for v in spread)
        edges = ([] if better == "lower" else [low - below]) + ([] if high is None or better == "higher"
                                                                   else [high + above])
        if any(lo < edge < hi for edge in edges):
            return (f"inconclusive: the measurement's noise allows {lo:.3g}-{hi:.3g}{unit}, which straddles the "
                    f"edge of the claimed {claim}")
    if low <= measured and (high is None or measured <= high):
        return f"within the claimed {claim}"
    if low - below <= measured and (high is None or measured <= high + above):
        tolerance = f"±{below:g}{unit}" if below == above else f"-{below:g}/+{above:g}{unit}"
        return f"within the claimed {claim}, given the tolerance {tolerance}"
    end = "it" if high == low else ("its low end" if measured < low else "its high end")
    if (better == "higher" and high is not None and measured > high) or (better == "lower" and measured < low):
        factor = (f" ({measured / high:.3g}x its high end)" if measured > high and high > 0 else
                  f" ({low / measured:.3g}x under its low end)" if measured < low and measured > 0 and low > 0 else "")
        return f"beyond the claimed {claim}{factor}, in the direction the advice promises"
    if measured < low:
        factor = f" ({low / measured:.3g}x under {end})" if measured > 0 and low > 0 else ""
        return f"below the claimed {claim}{factor}"
    factor = f" ({measured / high:.3g}x over {end})" if high > 0 else ""
    return f"above the claimed {claim}{factor}"


def answer(placement: str) -> str:
    """The appendix's answer for one of `verdict`'s sentences: within -> holds, beyond -> exceeds the claim,
    below/above -> does not hold."""
    if placement.startswith("within"):
        return "holds"
    if placement.startswith("beyond"):
        return "exceeds the claim"
    if placement.startswith(("below", "above")):
        return "does not hold"
    if placement.startswith("inconclusive"):
        return "inconclusive"
    return "not comparable here"


def _lacks(missing) -> str:
    return "missing here: " + "; ".join(missing) if missing else ""


GIB = 2 ** 30
# A model "of X's size": its parameter count within this factor of X's, either way. What a claim about a named
# model turns on here (bytes per gradient, per bucket, per all-reduce) scales with the parameter count.
SIZE_CLASS = 2.0


def machine_setting() -> dict:
    """The facts of this machine a claim's setting is made of: GPUs (count, names, compute capability, memory of
    the first), InfiniBand or RoCE devices (/sys/class/infiniband), NUMA nodes, numactl, cores, host memory, TCP
    buffers, and the nodes the job was allocated (SLURM's count; 1 outside SLURM). The allocation is shown, never
    used as a claim's node count: a cell's ranks span the nodes its launch put them on (`workload(hosts=...)`)."""
    import os

    import torch

    from helpers.devices import machine_facts
    from helpers.measure.ceilings import transport_facts

    facts, net = machine_facts(), transport_facts()
    gpus = facts["gpus"]
    capability = torch.cuda.get_device_capability(0) if gpus else None
    memory = torch.cuda.get_device_properties(0).total_memory if gpus else 0
    allocated = int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)
    return {"gpus": gpus, "gpu_names": facts["gpu_names"], "capability": capability, "gpu_memory": memory,
            "allocated_nodes": allocated, "infiniband": net["infiniband"], "numa_nodes": net["numa_nodes"] or 1,
            "numactl": net["numactl"], "cores": facts["cores"],
            "host_memory": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "tcp_rmem": net["tcp_rmem"]}


def workload(*, params: float | None = None, ranks: int | None = None, hosts=None, memory: float | None = None,
             peak: float | None = None) -> dict:
    """The facts of a cell's run that a claim's setting may also name, for `missing`:

    params: the model's parameter count. ranks: the world size of the run. hosts: the host name each rank (or
    agent) reported; the run spans as many nodes as there are distinct names. A launch from this kernel puts
    every rank on this machine, whatever the job was allocated; None: not known. memory: the bytes one rank may
    use (a cap the run is held to, or its whole device). peak: the bytes one step of the run peaked at, per rank.
    """
    return {"params": params, "ranks": ranks, "nodes": len(set(hosts)) if hosts else None, "memory": memory,
            "peak": peak}


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.0f} GiB"


def missing(machine: dict, run: dict | None = None, *, gpus: int = 0, gpu_memory: float = 0,
            capability: tuple[int, int] | None = None, nodes: int = 1, infiniband: bool = False, numa_nodes: int = 1,
            model: tuple[str, float] | None = None, ranks: int | None = None,
            out_of_memory: bool = False) -> list[str]:
    """Each fact of a claim's setting that `machine` (`machine_setting()`, or a test's stand-in) or the cell's
    `run` (`workload(...)`) lacks, as a phrase naming what the claim needs and what is here; [] where the setting
    is present.

    Machine facts: gpus, capability, infiniband, numa_nodes, and GPUs of `gpu_memory` bytes. Workload facts: a run
    held to `gpu_memory` bytes a GPU (within 5%: a claim about 80 GiB GPUs is judged at 80 GiB, not on a larger
    GPU's whole memory), ranks on `nodes` nodes (the nodes its launch spans), a `model` (name, parameters) of that
    size class (`SIZE_CLASS`), a run on `ranks` ranks, a step that does not fit (`out_of_memory`: its peak above
    the memory a rank has)."""
    run = run or {}
    lacks = []
    if machine["gpus"] < gpus:
        lacks.append(f"{gpus} GPU(s) (this machine has {machine['gpus']})")
    if gpu_memory and machine["gpus"]:
        held = run.get("memory") or machine["gpu_memory"]
        if machine["gpu_memory"] < 0.95 * gpu_memory:
            lacks.append(f"GPUs of {_gib(gpu_memory)} (this machine's first has {_gib(machine['gpu_memory'])})")
        elif abs(held / gpu_memory - 1) > 0.05:
            lacks.append(f"a run held to {_gib(gpu_memory)} a GPU, the claim's GPUs (this one may use {_gib(held)})")
    if capability and machine["gpus"] and tuple(machine["capability"] or (0, 0)) < tuple(capability):
        lacks.append(f"compute capability {capability[0]}.{capability[1]} or later "
                     f"(this machine's is {'.'.join(map(str, machine['capability']))})")
    if nodes > 1 and (run.get("nodes") or 0) < nodes:
        spans = f"this launch spans {run['nodes']}" if run.get("nodes") else "no launch across nodes was described"
        lacks.append(f"ranks on {nodes} nodes ({spans}; the job holds {machine.get('allocated_nodes', 1)})")
    if infiniband and not machine["infiniband"]:
        lacks.append("an InfiniBand or RoCE device (/sys/class/infiniband is empty or absent)")
    if machine["numa_nodes"] < numa_nodes:
        lacks.append(f"{numa_nodes} NUMA nodes (this machine has {machine['numa_nodes']})")
    if model:
        name, size = model
        have = run.get("params")
        if not have or not size / SIZE_CLASS <= have <= size * SIZE_CLASS:
            lacks.append(f"a model the size of {name} ({size / 1e6:.1f} M parameters, within {SIZE_CLASS:g}x; "
                         + (f"this one has {have / 1e6:.2g} M)" if have else "this run's is not known)"))
    if ranks is not None and run.get("ranks") != ranks:
        lacks.append(f"a run on {ranks} ranks (this one used {run.get('ranks')})")
    if out_of_memory and not (run.get("peak") and run.get("memory") and run["peak"] > run["memory"]):
        lacks.append("a step that does not fit in memory (" + (
            f"this one peaks at {run['peak'] / 2 ** 20:.3g} MiB a rank of the {_gib(run['memory'])} a rank has)"
            if run.get("peak") and run.get("memory") else "this run's peak or memory is not known)"))
    return lacks


@dataclass
class Judged:
    """One row of the appendix: the advice, the setting it assumes, what this machine measured, the verdict.

    value and claim (low, high) and spread are kept for the summary figure where the advice is a number."""
    slug: str
    advice: str
    setting: str
    measured: str
    verdict: str
    value: float | None = None
    claim: tuple[float, float | None] | None = None
    spread: tuple[float, float] | None = None

    @property
    def answer(self) -> str:
        return next(a for a in ANSWERS if self.verdict.startswith(a))

    def __str__(self) -> str:
        return (f"advice:   {self.advice}\nsetting:  {self.setting}\nmeasured: {self.measured}\n"
                f"verdict:  {self.verdict}")


def judge(slug: str, advice: str, setting: str, measured: str, value: float | None, low: float,
          high: float | None, *, missing: list[str] | tuple = (), **placement) -> Judged:
    """A numeric claim (`value` against [low, high], with `verdict`'s keywords: slack, unit, spread, better) as a
    row whose verdict starts with one of ANSWERS, followed by where the value fell. missing: the facts of the
    claim's setting this machine lacks (`missing(...)`); any makes the row 'not comparable here', naming them."""
    if "applicable" in placement or "reason" in placement:
        raise TypeError("judge takes the setting's missing facts (missing=...), not a typed applicable=")
    placed = verdict(value, low, high, applicable=not missing, reason=_lacks(missing), **placement)
    if placed == "not measured here":
        placed = "not comparable here: not measured on this machine"
    said = answer(placed)
    text = placed if said in ("inconclusive", "not comparable here") else f"{said}: {placed}"
    return Judged(slug, advice, setting, measured, text, value, (low, high), placement.get("spread"))


def judge_finding(slug: str, advice: str, setting: str, measured: str, holds: bool | None, why: str, *,
                  missing: list[str] | tuple = ()) -> Judged:
    """Advice whose test is a finding, not a figure: `holds` as computed from what was run, and why. missing: as
    for `judge` (holds may then be None: nothing was run)."""
    if missing:
        return Judged(slug, advice, setting, measured, f"not comparable here: {_lacks(missing)}")
    if holds is None:
        raise ValueError("a finding with nothing missing needs holds: True or False")
    return Judged(slug, advice, setting, measured, f"{'holds' if holds else 'does not hold'}: {why}")


def summary_table(rows: list[Judged], width: int = 60) -> str:
    """The summary as fixed-width text, one line per judged claim: slug, answer, then advice, setting, measured
    and verdict, each shortened to `width` characters."""
    def cut(text: str) -> str:
        return text if len(text) <= width else text[:width - 1] + "…"

    lines = [f"{'slug':<32} {'answer':<20} advice | setting | measured | verdict"]
    for r in rows:
        lines.append(f"{r.slug:<32} {r.answer:<20} {cut(r.advice)} | {cut(r.setting)} | {cut(r.measured)} | "
                     f"{cut(r.verdict)}")
    return "\n".join(lines)


def answer_counts(rows: list[Judged]) -> dict[str, int]:
    """How many rows got each answer, in ANSWERS' order."""
    return {a: sum(r.answer == a for r in rows) for a in ANSWERS}
