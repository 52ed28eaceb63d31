"""FSDP trained in lockstep beside the unsharded model it should equal: the check that sharding changes nothing.

Why a harness: the claim "FSDP trains like one process on the whole batch" needs a reference that sees the global
batch while each rank trains on its slice of the same batch, the same optimizer on both, the ranks' losses averaged,
and a distance between the whole parameters taken relative to how far the reference moved (Adam turns any gradient,
even rounding noise where the true gradient is zero, into a step of about `lr`, so elementwise closeness means
little there). None of that is what a reader learns; the FSDP step (passed in as `fsdp_step`) is. Runs in a worker.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


def train_beside_reference(device, model, reference, fsdp_step, loss_of, batch, steps: int, per_rank_batch: int,
                           lr: float, accum: int = 1, max_norm: float | None = None,
                           collective_log=None) -> dict:
    """Train `model` (sharded, on this rank's slice) and `reference` (whole, on the global batch) side by side.

    `fsdp_step(micro_batches)` runs FSDP's forward and backward over this rank's `accum` micro-batches and returns
    (summed loss tensor, total gradient norm as a tensor, a DTensor or None); the harness then steps Adam. The
    reference clips its gradients with `max_norm` when given. `batch(n, generator=g)` draws n (input, target) rows;
    every rank draws the same global batches. Returns plain values: the losses (FSDP's averaged over ranks) and
    the reference's step by step, the gradient norms, the first step's collectives (`collective_log`, a class, when
    given), the parameters' distance to the reference relative to the distance the reference travelled, and the
    element that differs most as (gap, parameter name, flat index).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    initial = [p.detach().clone() for p in reference.parameters()]
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=lr) for m in (model, reference))
    gen = torch.Generator().manual_seed(1)                      # the same global batches on every rank
    r = {"losses": [], "ref_losses": [], "norms": [], "ref_norms": []}
    for step in range(steps):
        x, y = (t.to(device) for t in batch(per_rank_batch * accum * world, generator=gen))
        ref_loss = loss_of(reference(x), y)                     # the whole batch, one process
        ref_loss.backward()
        if max_norm is not None:
            r["ref_norms"].append(torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm).item())
        ref_opt.step()
        ref_opt.zero_grad()
        mine = slice(rank * accum * per_rank_batch, (rank + 1) * accum * per_rank_batch)
        log = collective_log() if collective_log and step == 0 else contextlib.nullcontext()
        with log:
            total, norm = fsdp_step(list(zip(x[mine].chunk(accum), y[mine].chunk(accum))))
        if norm is not None:
            r["norms"].append(norm.full_tensor().item() if hasattr(norm, "full_tensor") else float(norm))
        opt.step()
        opt.zero_grad()
        total = total.detach().clone()
        dist.all_reduce(total)                                  # SUM: gloo has no AVG
        r["losses"].append(total.item() / world)
        r["ref_losses"].append(ref_loss.item())
        if collective_log and step == 0:
            r["collectives"] = log.summary()
    with torch.no_grad():
        names = [n for n, _ in reference.named_parameters()]
        full = [p.to(device).full_tensor() for p in model.parameters()]   # all-gathers each parameter
        gap = sum(((f - q) ** 2).sum() for f, q in zip(full, reference.parameters())).sqrt().item()
        travelled = sum(((q - i) ** 2).sum() for q, i in zip(reference.parameters(), initial)).sqrt().item()
        r["worst"] = max(((f - q).abs().max().item(), n, (f - q).abs().argmax().item())
                         for f, q, n in zip(full, reference.parameters(), names))
    r["relative_gap"] = gap / travelled
    return r
