"""helpers.measure.tensor_parallel: the table of what notebook 07's TP workers returned, the collectives and bytes of a
step, and the graph-counting compile backend. Real processes (2 CPU ranks, gloo) through helpers.launch."""
from __future__ import annotations

import pytest

from helpers.launcher import launch
from helpers.measure import tensor_parallel


def test_tp_table_prints_each_setting_with_its_gaps_and_block_zero_collectives():
    report = {"logits_placements": "(Shard(dim=2),)", "logits_gap": 1.5e-7, "grad_gap": 2.5e-7,
              "per_module": {"Llama.layers.0": {"forward": {"all_reduce": 2}}}, "total": {"all_reduce": 7}}
    lines = tensor_parallel.tp_table({False: report, True: {**report, "per_module": {}}}).splitlines()
    assert len(lines) == 6
    assert lines[0] == ("sequence parallel False: logits (Shard(dim=2),), max |logits - reference| 1.50e-07, "
                        "max |grad - reference| 2.50e-07")
    assert lines[1] == "  collectives of block 0: forward {'all_reduce': 2}, backward {}"
    assert lines[2] == "  whole step: {'all_reduce': 7}"
    assert lines[4] == "  collectives of block 0: forward {}, backward {}"


def _two_all_reduces(step_collectives):
    import gc

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        t = torch.ones(256)
        return step_collectives(lambda: [dist.all_reduce(t) for _ in range(2)])
    finally:
        gc.collect()
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_step_collectives_counts_the_calls_and_bytes_of_the_step_it_is_handed():
    for r in launch(_two_all_reduces, tensor_parallel.step_collectives, world_size=2):
        assert list(r["collectives"]) == ["all_reduce"] and r["collectives"]["all_reduce"]["calls"] == 2
        # a ring all-reduce of B bytes sends 2 (w - 1) / w * B per rank: B on 2 ranks, twice
        assert r["bytes_sent"] == r["collectives"]["all_reduce"]["ring_bytes"] == 2 * 256 * 4


def test_graph_counter_counts_each_graph_and_refuses_an_unknown_backend():
    import torch

    counter = tensor_parallel.GraphCounter("eager")
    eager = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
    x = torch.randn(2, 3)
    out = torch.compile(eager, backend=counter)(x)
    assert len(counter.graphs) == 1 and counter.graphs[0] >= 3  # at least the input, a module's call, the output
    assert torch.allclose(out, eager(x)), "the wrapped backend still compiles the graph it counted"
    with pytest.raises(ValueError, match="unknown torch.compile backend"):
        tensor_parallel.GraphCounter("no-such-backend")
