"""The lockstep harness: FSDP on rank slices against one process on the whole batch, and a detected difference."""
from __future__ import annotations

import torch


def _reference_worker(wrong):
    import warnings

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from helpers.measure.fsdp import train_beside_reference

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    try:
        def make():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

        model, reference = fully_shard(make(), mesh=init_device_mesh("cpu", (dist.get_world_size(),))), make()
        loss_of = lambda logits, y: F.cross_entropy(logits, y)

        def fsdp_step(micro_batches):
            (x, y), = micro_batches
            if wrong:                                   # a deliberately wrong step: half this rank's slice
                x, y = x[:2], y[:2]
            loss = loss_of(model(x), y)
            loss.backward()
            return loss.detach(), None

        batch = lambda n, generator: (torch.randn(n, 6, generator=generator),
                                      torch.randint(0, 3, (n,), generator=generator))
        return train_beside_reference("cpu", model, reference, fsdp_step, loss_of, batch, steps=3, per_rank_batch=4,
                                      lr=0.01)
    finally:
        dist.destroy_process_group()


def test_fsdp_matches_the_reference_and_a_wrong_step_does_not():
    import helpers

    for r in helpers.launch(_reference_worker, False, world_size=2, timeout=120, quiet=True):
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(r["losses"], r["ref_losses"]))
        assert r["relative_gap"] < 1e-3 and r["norms"] == [] and len(r["losses"]) == 3
    for r in helpers.launch(_reference_worker, True, world_size=2, timeout=120, quiet=True):
        assert r["relative_gap"] > 1e-2, "training on other data leaves the reference's path"
