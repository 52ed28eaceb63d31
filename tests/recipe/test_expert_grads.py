"""train.py's `average_expert_grads` where each expert is held by more than one rank (--ep smaller than the
data-parallel ranks): after it, every holder's expert gradient is the mean over all data-parallel ranks of what
each rank's own tokens gave that expert, the gradient one process computes from the whole batch's mean loss. Two
gloo ranks hold the same 2 experts (an ep mesh of 1, replicas 2), each with its own tokens. The recipe's torchrun
tests run --ep over 2 ranks with no replicas; this is the other branch, at the cost of one launch.
"""
from __future__ import annotations

import sys

from helpers import launch
from helpers.devices import CPU_ONLY_ENV
from helpers.paths import SCRIPTS

if str(SCRIPTS / "train") not in sys.path:  # the recipe's modules, imported by name as the notebooks do
    sys.path.insert(0, str(SCRIPTS / "train"))


def holders_average(dp: int):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import train
    from config import LlamaArgs
    from model import Llama, cross_entropy
    from moe import apply_ep, apply_moe

    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        cfg = LlamaArgs(vocab_size=64, dim=16, n_layers=1, n_heads=2, max_seq_len=8, multiple_of=16)
        with torch.device("meta"):
            model = Llama(cfg)
            apply_moe(model, 2, 1)
        mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("ep_replica", "ep"))
        apply_ep(model, mesh["ep"])
        model.to_empty(device="cpu")
        model.init_weights(0)
        tokens = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(rank))   # each rank its own
        cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        experts = {n: p for n, p in model.named_parameters() if ".experts." in n}
        own = {n: p.grad.to_local().clone() for n, p in experts.items()}
        train.average_expert_grads(model, mesh["ep_replica"], dp)
        everyone = {}
        for n, g in own.items():
            pieces = [torch.empty_like(g) for _ in range(dist.get_world_size())]
            dist.all_gather(pieces, g)
            everyone[n] = torch.stack(pieces).sum(0) / dp
        return {"differ_before": any(not torch.allclose(g, everyone[n]) for n, g in own.items()),
                "mean_after": all(torch.allclose(experts[n].grad.to_local(), want, rtol=1e-6, atol=1e-8)
                                  for n, want in everyone.items())}
    finally:
        dist.destroy_process_group()


def test_experts_held_by_two_ranks_get_the_mean_of_both_ranks_gradients():
    ranks = launch(holders_average, 2, world_size=2, timeout=120, env=CPU_ONLY_ENV)
    assert all(r["differ_before"] for r in ranks), "each rank's tokens gave its experts their own gradient"
    assert all(r["mean_after"] for r in ranks), "summed over the holders, divided by the data-parallel ranks"
