"""The torchrun agents of notebook 09's multi-node demos (helpers.cluster.agents): held and released, killed with
their workers, gone with the kernel that started them. Every wait is bounded, and nothing is left running: not the
agents, and not their workers, which torchrun puts in sessions of their own (the cause of the hang this file guards
against: a killed agent's workers lived on, and the survivor waited in torchrun's exit barrier).

The elastic job itself (agent A trains alone, B joins, B is lost, A finishes, every start resuming from the last
committed checkpoint) is notebook 09's section 3b, which asserts each of those properties and that nothing of the
job is left; the notebook runs in the suite, so it is not run a second time here.
"""
from __future__ import annotations

import os
import re
import time

import psutil

from helpers.cluster import agents
from helpers.launcher.api import free_port
from helpers.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "cluster_ddp.py"
WAIT = 600  # seconds any one wait may take: each of these tests took at most 21 s on a loaded 2-core machine
ENV = {"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "LOGLEVEL": "INFO",
       "CUDA_VISIBLE_DEVICES": ""}


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
    gone, alive = psutil.wait_procs(workers, timeout=WAIT)  # killed: gone within a second here
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
