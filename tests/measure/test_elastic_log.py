"""The tables and reports notebook 09 prints from an elastic run's records (helpers.measure.elastic_log)."""
from __future__ import annotations

from types import SimpleNamespace

from helpers.measure.elastic_log import agents_report, environment_table, stretches_report


def test_environment_table_one_line_per_worker_ordered_by_rank():
    starts = [{"RANK": "10", "GROUP_RANK": "1", "MASTER_PORT": "29500"},
              {"RANK": "2", "GROUP_RANK": "0", "MASTER_PORT": "29500"}]
    lines = environment_table(starts, ["RANK", "GROUP_RANK"]).splitlines()
    assert [line.split() for line in lines] == [["RANK", "GROUP_RANK"], ["2", "0"], ["10", "1"]]
    assert len({len(line) for line in lines}) == 1, "columns aligned"


def test_stretches_report_names_each_start_and_its_steps():
    runs = [{"world": 1, "restart_count": 0, "group_rank": 0, "last_saved_before": 0, "losses": {1: 0.5, 2: 0.4}},
            {"world": 2, "restart_count": 0, "group_rank": 0, "last_saved_before": 2, "losses": {}}]
    lines = stretches_report(runs).splitlines()
    assert lines[0].startswith("start 1: world size 1, restart count 0") and lines[0].endswith("trained steps 1..2")
    assert "newest checkpoint logged before it: step 2" in lines[1] and lines[1].endswith("trained steps -..-")


def test_agents_report_keeps_rendezvous_results_and_notable_lines_without_log_prefix():
    result = {"time": "12:00:01.5", "group_rank": 1, "group_world_size": 2, "restart_count": 0,
              "global_ranks": [1], "global_world_sizes": [2]}
    output = ("I1123 12:00:02.000000 42 api.py:962] [default] Detected 1 new nodes from group_rank=0\n"
              "I1123 12:00:02.100000 42 api.py:733] [default] Stopping worker group\n"
              "summary: world=1 loss=0.2\n")
    node = SimpleNamespace(name="B", output=output, rendezvous=lambda: [result])
    lines = agents_report([node]).splitlines()
    assert lines == ["  B 12:00:01.5: rendezvous complete, group_rank=1 group_world_size=2 restart_count=0 "
                     "global_ranks=[1] of world [2]",
                     "  B | [default] Detected 1 new nodes from group_rank=0",
                     "  B | summary: world=1 loss=0.2"]
