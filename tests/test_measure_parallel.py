"""helpers.measure.parallel turns what a tensor-parallel model computed into plain numbers: equal to the unsplit
model's outputs and gradients, the bytes each rank holds, the collectives per module, and where every element
lives. Real processes (2 CPU ranks, gloo) through helpers.launch."""
from __future__ import annotations

import pytest

from helpers.launcher import launch
from helpers.measure import parallel


def _tp_mlp_report(report, element_owners):
    import gc

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
        torch.manual_seed(0)
        reference = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        ref_out = reference(x)
        ref_out.sum().backward()
        torch.manual_seed(0)
        model = parallelize_module(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)), mesh,
                                   {"0": ColwiseParallel(),
                                    "2": RowwiseParallel(output_layouts=Replicate(), use_local_output=False)})
        with CommDebugMode() as comm:
            out = model(x)
            out.sum().backward()
        result = report(model, out, reference, ref_out, comm)
        result["layout"] = element_owners(model)
        del model, out, comm, mesh
        return result
    finally:
        gc.collect()
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_tp_report_and_element_owners_on_a_column_then_row_parallel_mlp():
    results = launch(_tp_mlp_report, parallel.tp_report, parallel.element_owners, world_size=2)
    for r in results:
        assert r["logits_close"] and r["grads_close"] and r["logits_gap"] < 1e-5 and r["grad_gap"] < 1e-5
        # w1 (8x4) and its bias split by rows, w2 (4x8) by columns; w2's bias (4) whole on each rank
        assert r["local_param_bytes"] == 4 * ((8 * 4 + 8 + 4 * 8) // 2 + 4)
        assert r["placements"]["0.weight"] == "(Shard(dim=0),)" and r["placements"]["2.bias"] == "(Replicate(),)"
        assert r["total"] == {"all_reduce": 1}  # the row-parallel layer's partial sums, once, in forward
        assert r["layout"]["layout_ok"]
        assert r["layout"]["shapes"]["0.weight"] == (8, 4) and r["layout"]["placements"]["2.bias"] == "(Replicate(),)"
    for name, numel, copies in (("0.weight", 32, 1), ("2.weight", 32, 1), ("2.bias", 4, 2)):
        held = sorted(i for r in results for i in r["layout"]["owners"][name].tolist())
        assert held == sorted(list(range(numel)) * copies), name



def test_tp_table_prints_each_setting_with_its_gaps_and_block_zero_collectives():
    report = {"logits_placements": "(Shard(dim=2),)", "logits_gap": 1.5e-7, "grad_gap": 2.5e-7,
              "per_module": {"GPT.blocks.0": {"forward": {"all_reduce": 2}}}, "total": {"all_reduce": 7}}
    lines = parallel.tp_table({False: report, True: {**report, "per_module": {}}}).splitlines()
    assert len(lines) == 6
    assert lines[0] == ("sequence parallel False: logits (Shard(dim=2),), max |logits - reference| 1.50e-07, "
                        "max |grad - reference| 2.50e-07")
    assert lines[1] == "  collectives of block 0: forward {'all_reduce': 2}, backward {}"
    assert lines[2] == "  whole step: {'all_reduce': 7}"
    assert lines[4] == "  collectives of block 0: forward {}, backward {}"
