"""The seed articles' checkpointing and fault-tolerance advice (seed 002), run as written or judged beside what
notebook 06 measured.

Why a module: notebook 06 must show the DCP calls, the kill and the restart; catching a deprecated call's warning,
exec'ing an article's snippet as written, probing for command-line tools and wording each verdict are bookkeeping
around them. The `*_as_written` functions run the article's code and return what happened (the notebook asserts
on it); the verdict functions take figures already measured and return text (`claims.verdict`: 'inconclusive'
where the noise straddles the claim's edge, 'not comparable here' where the claim's setting is not this machine's).
Nothing here asserts anything about a timing.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import shutil
import warnings
from pathlib import Path

from helpers.measure.claims import verdict

ELASTIC_AGENT_SNIPPET = '''
from torch.distributed.elastic import agent
trainer = agent.LocalElasticAgent(spec=WorkerSpec(entrypoint="train.py", args=()), start_method="spawn")
'''


def save_state_dict_as_written(folder) -> tuple[type, str]:
    """Seed 002 saves with `save_state_dict(checkpoint, checkpoint_id=...)`. Returns the category of the warning
    that the old name raises when called its own way (with a storage writer), and what the article's call did."""
    import torch
    import torch.distributed.checkpoint as dcp

    Path(folder).mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.save_state_dict({"w": torch.zeros(2)}, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
        try:
            dcp.save_state_dict({"w": torch.zeros(2)}, checkpoint_id=str(folder))
            call = "accepted"
        except TypeError as exc:
            call = f"TypeError: {exc}"
    deprecation = next(w for w in caught if "save_state_dict" in str(w.message))
    print(f"dcp.save_state_dict -> {deprecation.category.__name__}: {deprecation.message}")
    print(f"the article's save_state_dict(checkpoint, checkpoint_id=...) -> {call}")
    return deprecation.category, call


def elastic_agent_as_written(snippet: str = ELASTIC_AGENT_SNIPPET) -> str:
    """Seed 002's "handle node failures with the Elastic Launcher" snippet, run as written: 'ran', or the error."""
    try:
        exec(snippet, {})
        outcome = "ran"
    except Exception as exc:  # the snippet is the article's, not ours: any failure is the finding
        outcome = f"{type(exc).__name__}: {exc}"
    print(f"LocalElasticAgent snippet, as written -> {outcome}")
    return outcome


def debugging_tools() -> str:
    """Seed 002's debugging advice (`torch.distributed.launch`, NVIDIA's `dcgmi`, `memory_profiler`): the warning
    torch.distributed.launch prints (its `--help`, run in this process), and whether the two tools are here."""
    import torch.distributed.launch

    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("always")
        with contextlib.suppress(SystemExit):
            torch.distributed.launch.main(["--help"])
    warned = next(str(w.message) for w in caught if "torch.distributed.launch" in str(w.message))
    return "\n".join([f"torch.distributed.launch -> {' '.join(warned.splitlines()[:2])}",
                      f"dcgmi on this machine: {shutil.which('dcgmi') or 'not installed'}; memory_profiler: "
                      f"{'installed' if importlib.util.find_spec('memory_profiler') else 'not installed'}"])


def save_rates(summary: dict, on_gpu: bool) -> str:
    """The two targets of a save, judged from `disk.summarize_costs`' ratios (taken side by side per repeat): DCP's
    own costs take at most half of a save (dcp.save at 0.5x the disk's fsync'd rate or more), and on GPUs
    async_save blocks the caller for at most 0.2x a synchronous save (its staging is a device-to-host copy)."""
    save_vs_disk, blocking = summary["ratios"]["save_vs_disk"], summary["ratios"]["blocking_share"]
    return "\n".join([
        f"dcp.save ran at {save_vs_disk['median']:.2f}x the disk's fsync'd write rate (median; {_spread(save_vs_disk)}; "
        "target: DCP's own costs take at most half of a save):",
        "   " + verdict(save_vs_disk["median"], 0.5, None, unit="x", spread=save_vs_disk["interval"]),
        f"async_save blocked the caller for {blocking['median']:.2f}x a synchronous save's time (median; "
        f"{_spread(blocking)}; target on GPUs: at most 0.2x):",
        "   " + verdict(blocking["median"], 0, 0.2, unit="x", spread=blocking["interval"], applicable=on_gpu,
                        reason="the target is for CUDA tensors, whose staging is a device-to-host copy; these ranks "
                               "hold CPU tensors, staged within host memory"),
        "A load right after a save reads from the page cache; from a cold disk it would be slower."])


def _spread(ratio: dict) -> str:
    """The noise of a ratio's median, for a figure copied elsewhere: its bootstrap interval (and the repeats' range
    where `disk.summarize_costs` kept them)."""
    lo, hi = ratio["interval"]
    text = f"bootstrap interval of the median {lo:.2f}-{hi:.2f}x"
    if ratio.get("values"):
        text += f", {len(ratio['values'])} repeats {min(ratio['values']):.2f}-{max(ratio['values']):.2f}x"
    return text


def new_node_within_seconds(restart_s: float) -> str:
    """Seed 002: "when a node fails, a new node resumes training within seconds", beside torchrun's restart here."""
    return "'a new node resumes training within seconds' -> " + verdict(
        restart_s, 0, 60, unit=" s", applicable=False,
        reason=f"the claim is for a cloud cluster replacing a failed node (provisioning, rendezvous across "
               f"machines); here torchrun restarted processes on one machine, in {restart_s:.1f} s")


def ntp_across_nodes(cores: int) -> str:
    """Seed 002: "keep NTP time sync across nodes"; one machine has one clock."""
    return "NTP across nodes -> " + verdict(
        None, 0, 0, applicable=False,
        reason=f"one machine ({cores} cores), one clock; the advice concerns clocks of several nodes, for timestamps "
               "compared across them (torchrun's root cause, logs), not for rendezvous or collectives")
