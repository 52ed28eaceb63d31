"""Elastic torchrun (`--nnodes=1:2`) as notebook 09 runs it: a node that joins late, a node that is lost.

Agent A trains alone, agent B joins (world size 1 -> 2), B is killed (2 -> 1, restart 1), A finishes; every start
resumes from the last committed DCP checkpoint of scripts/cluster_ddp.py. Every wait is bounded, and nothing is left
running: not the agents, and not their workers, which torchrun puts in sessions of their own (the cause of the hang
this file guards against: a killed agent's workers lived on, and the survivor waited in torchrun's exit barrier).
"""
from __future__ import annotations

import os
import re
import signal
import time

import psutil

from helpers.cluster import agents
from helpers.launcher.api import free_port
from helpers.measure import elastic_log
from helpers.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "cluster_ddp.py"
STEPS, SAVE_EVERY = 30, 4
WAIT = 240  # seconds any one wait may take: generous, since the tests run with both cores busy
CONF = "--rdzv-conf=join_timeout=60,last_call_timeout=3,close_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"
ENV = {"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "LOGLEVEL": "INFO",
       "CUDA_VISIBLE_DEVICES": ""}


def test_a_node_joins_late_and_one_is_lost(tmp_path):
    port = free_port()
    common = dict(log_dir=tmp_path / "logs", nnodes="1:2", nproc=1, endpoint=f"127.0.0.1:{port}", run_id="t",
                  extra=(CONF, "--max-restarts=3"), env=ENV)
    args = ["--out", tmp_path / "run", "--steps", STEPS, "--batch", 16, "--hidden", 8, "--save-every", SAVE_EVERY,
            "--step-sleep", 0.2]
    node_a = agents.start_agent("A", SCRIPT, *args, **common)
    started = [node_a]
    try:
        agents.wait_listening(port, timeout=WAIT)
        node_b = agents.start_agent("B", SCRIPT, *args, **common, held=True)
        started.append(node_b)
        agents.wait_until(elastic_log.saved_past(tmp_path / "run", world=1), started, WAIT, "A alone")
        node_b.release()
        agents.wait_until(elastic_log.saved_past(tmp_path / "run", world=2), started, WAIT, "A and B")
        node_b.kill(signal.SIGKILL)
        assert agents.wait_all([node_a], WAIT) == [0], node_a.output[-3000:]
    finally:
        agents.stop_all(started)
    assert not agents.processes_mentioning(str(tmp_path)), "an agent or a worker of the job is left"

    runs = elastic_log.stretches(tmp_path / "run")
    assert [(r["world"], r["restart_count"]) for r in runs] == [(1, 0), (2, 0), (1, 1)], runs
    rounds = [(r["group_world_size"], r["restart_count"]) for r in node_a.rendezvous()]
    assert [r for i, r in enumerate(rounds) if rounds[i - 1:i] != [r]] == [(1, 0), (2, 0), (1, 1)], rounds
    for run in runs:  # each start resumes right after the last committed checkpoint and trains every step on
        assert sorted(run["losses"]) == list(range(run["last_saved_before"] + 1, max(run["losses"]) + 1)), runs
        assert run["last_saved_before"] % SAVE_EVERY == 0
    assert max(runs[-1]["losses"]) == STEPS and node_b.returncode == -signal.SIGKILL
    twice = [(a["losses"][s], b["losses"][s]) for a, b in zip(runs, runs[1:]) for s in a["losses"] if s in b["losses"]]
    assert twice and all(abs(x - y) <= 1e-5 for x, y in twice), "a redone step gives the same loss at any world size"


def test_kill_takes_the_agents_workers_with_it(tmp_path):
    """torchrun starts a script's workers in sessions of their own: killing the agent's session alone would leave
    them running. Agent.kill must take them too."""
    script = tmp_path / "sleepy.py"
    # one write of one line: two workers share the agent's pipe, and print's pieces interleave under -u
    script.write_text("import os, time\nos.write(1, f'worker pid {os.getpid()}\\n'.encode())\ntime.sleep(600)\n")
    agent = agents.start_agent("solo", script, log_dir=tmp_path, nnodes="1", nproc=2,
                               endpoint=f"127.0.0.1:{free_port()}", env={"LOGLEVEL": "INFO"})
    try:
        def pids():  # whole lines only: the agent's output is read as it arrives, a line may be half there
            return [int(pid) for pid in re.findall(r"worker pid (\d+)\n", agent.output)]

        agents.wait_until(lambda: len(pids()) == 2, [agent], WAIT, "two workers")
        workers = [psutil.Process(pid) for pid in pids()]
        assert all(os.getsid(w.pid) != os.getsid(agent.proc.pid) for w in workers), "workers in their own sessions"
        agent.kill()
    finally:
        agents.stop_all([agent])
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, f"workers outlived their agent: {alive}"


def test_a_held_agent_runs_torchrun_once_released(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], flush=True)\n")
    agent = agents.start_agent("held", script, log_dir=tmp_path, nnodes="1", nproc=1,
                               endpoint=f"127.0.0.1:{free_port()}", env={"LOGLEVEL": "INFO"}, held=True)
    try:
        time.sleep(1)
        assert agent.returncode is None and "rank" not in agent.output, "a held agent waits for its release"
        agent.release()
        assert agents.wait_all([agent], WAIT) == [0], agent.output
    finally:
        agents.stop_all([agent])
    assert "rank 0 of 1" in agent.output
    assert [(r["group_rank"], r["group_world_size"], r["restart_count"]) for r in agent.rendezvous()] == [(0, 1, 0)]
    assert agent.command[0].endswith("torchrun"), "the command shown is the torchrun line"


def test_a_held_agent_whose_kernel_is_gone_starts_nothing(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("print('worker started', flush=True)\n")
    agent = agents.start_agent("orphan", script, log_dir=tmp_path, nnodes="1", nproc=1,
                               endpoint=f"127.0.0.1:{free_port()}", held=True)
    try:
        agent.proc.stdin.close()  # what the kernel's death does to the pipe
        codes = agents.wait_all([agent], WAIT)
    finally:
        agents.stop_all([agent])
    assert codes != [0] and "worker started" not in agent.output and "stdin closed" in agent.output


def test_a_step_line_still_being_written_is_left_for_the_next_read(tmp_path):
    """wait_until polls the loss log while rank 0 appends to it: half a line must not be parsed (or crash)."""
    from helpers.measure.elastic_log import step_lines

    log = tmp_path / "losses.jsonl"
    log.write_text('{"step": 1, "saved": false}\n{"step": 2, "saved": true}\n{"step": 3, "sa')
    assert [line["step"] for line in step_lines(tmp_path)] == [1, 2]
    log.write_text(log.read_text() + 'ved": false}\n')
    assert [line["step"] for line in step_lines(tmp_path)] == [1, 2, 3]
