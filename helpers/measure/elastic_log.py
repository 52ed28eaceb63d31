"""An elastic run cut into the stretches its workers trained, read from what scripts/cluster_ddp.py leaves behind.

Why from the workers' own records and not from torchrun's log: an agent knows when it restarted its workers, but
only the workers know which checkpoint they resumed from, which world size they saw and which steps they trained.
cluster_ddp.py leaves two records in its `--out` folder: `env/attempt*_rank*_pid*.json`, one per worker start
(torchrun's environment and the time), and `losses.jsonl`, one line per step from rank 0, written after that
step's checkpoint (if any) was saved, so a line with `"saved": true` names a complete checkpoint.

A stretch begins at each start of rank 0: the steps logged from then until the next start of rank 0 are what that
generation of workers trained.

The `*_table`/`*_report` functions turn these records (and the agents' logs) into the lines notebook 09 prints.
"""
from __future__ import annotations

import json
import re
from pathlib import Path


def worker_starts(out) -> list[dict]:
    """Every worker start, oldest first: torchrun's environment (RANK, WORLD_SIZE, GROUP_RANK,
    TORCHELASTIC_RESTART_COUNT, ...), the pid and the time."""
    return sorted((json.loads(p.read_text()) for p in (Path(out) / "env").glob("attempt*_rank*.json")),
                  key=lambda s: s["time"])


def step_lines(out) -> list[dict]:
    """Rank 0's line per trained step (step, loss, world, saved, attempt, time), in the order written."""
    path = Path(out) / "losses.jsonl"
    if not path.exists():
        return []
    text = path.read_text()  # read while rank 0 appends: a line not yet ended is left for the next read
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]


def stretches(out) -> list[dict]:
    """One dict per start of rank 0, oldest first:

    world, restart_count, group_rank: what torchrun told that rank 0 (WORLD_SIZE, TORCHELASTIC_RESTART_COUNT,
      GROUP_RANK);
    losses: {step: loss} of the steps it trained;
    last_saved_before: the newest checkpoint logged as saved before it started (0: none). It resumes from that one
      or a newer one: a worker stopped after a commit but before its log line leaves that checkpoint unlogged.
    """
    starts = [s for s in worker_starts(out) if s["RANK"] == "0"]
    lines = step_lines(out)
    result = []
    for i, start in enumerate(starts):
        until = starts[i + 1]["time"] if i + 1 < len(starts) else float("inf")
        mine = [line for line in lines if start["time"] <= line["time"] < until]
        saved = [line["step"] for line in lines if line["time"] < start["time"] and line["saved"]]
        result.append({"world": int(start["WORLD_SIZE"]), "restart_count": int(start["TORCHELASTIC_RESTART_COUNT"]),
                       "group_rank": int(start["GROUP_RANK"]), "time": start["time"],
                       "losses": {line["step"]: line["loss"] for line in mine},
                       "last_saved_before": max(saved, default=0)})
    return result


def saved_past(out, world: int, steps_after: int = 2):
    """A condition for `agents.wait_until`: the workers at `world` ranks have saved a checkpoint of their own and
    trained `steps_after` steps beyond it (so a restart now redoes those steps from that checkpoint)."""
    def reached() -> bool:
        lines = [line for line in step_lines(out) if line["world"] == world]
        saved = [line["step"] for line in lines if line["saved"]]
        return bool(saved) and max(line["step"] for line in lines) >= saved[0] + steps_after

    return reached


def environment_table(starts: list[dict], columns: list[str]) -> str:
    """What torchrun told each worker (`worker_starts` records) as a table: one line per start, ordered by RANK."""
    width = {c: max(len(c), 10) for c in columns}
    lines = ["  ".join(f"{c:>{width[c]}}" for c in columns)]
    for start in sorted(starts, key=lambda s: int(s["RANK"])):
        lines.append("  ".join(f"{str(start[c]):>{width[c]}}" for c in columns))
    return "\n".join(lines)


def stretches_report(runs: list[dict]) -> str:
    """One line per start of rank 0 (`stretches`): the world size and restart count torchrun gave it, the newest
    checkpoint logged before it and the steps it trained."""
    return "\n".join(
        f"start {i}: world size {run['world']}, restart count {run['restart_count']}, rank 0 on group "
        f"{run['group_rank']}; newest checkpoint logged before it: step {run['last_saved_before']}; trained steps "
        f"{min(run['losses'], default='-')}..{max(run['losses'], default='-')}" for i, run in enumerate(runs, 1))


NOTABLE = r"new nodes|Worker group FAILED|by peer|^summary:|Done waiting"


def agents_report(nodes, notable: str = NOTABLE) -> str:
    """What each agent (`helpers.cluster.agents.Agent`) logged that tells the story of an elastic run: every
    completed rendezvous (needs LOGLEVEL=INFO), then its lines matching `notable`, without torchrun's log prefix."""
    lines = []
    for node in nodes:
        lines += [f"  {node.name} {r['time']}: rendezvous complete, group_rank={r['group_rank']} group_world_size="
                  f"{r['group_world_size']} restart_count={r['restart_count']} global_ranks={r['global_ranks']} "
                  f"of world {r['global_world_sizes']}" for r in node.rendezvous()]
        lines += [f"  {node.name} | {line.split('] ', 1)[-1][:140]}" for line in node.output.splitlines()
                  if re.search(notable, line)]
    return "\n".join(lines)
