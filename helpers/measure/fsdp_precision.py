"""What a `MixedPrecisionPolicy` changes, seen from inside one rank: dtypes, bytes on the wire, state, activations.

Why a module: notebook 03b claims that a bf16 `param_dtype` all-gathers and computes in bf16 while the sharded
parameters, their gradients and Adam's state stay fp32 (so the persistent bytes per rank do not change), that
`reduce_dtype=torch.float32` reduce-scatters in fp32, and that a loss taken on `logits.float()` loses nothing
against float64. Checking that takes a forward hook on one layer, a collective log and an activation meter around
the first step, the state after it, and the loss of the same logits computed three ways: measuring machinery, not
what a reader copies (the policy itself is one line where the model is built). Runs in a worker.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from helpers.measure.activations import SavedActivations
from helpers.measure.comm_log import CollectiveLog
from helpers.measure.memory import model_state_bytes


def precision_report(model, probe: str, loss_of, batch, steps: int, lr: float, device, seed: int) -> dict:
    """Train `model` `steps` Adam steps on `batch(generator=g)` batches and report what its precision policy did.

    `probe` names a Linear inside the model (e.g. "blocks.0.linear1"): the dtypes of its weight during forward,
    its output, its sharded weight and its gradient. The first step is measured: collectives
    (`CollectiveLog.summary()`), activations saved for backward, model state bytes after the optimizer step, and
    the cross-entropy of its logits in float64, float32 and the logits' own dtype. Returns plain values.
    """
    layer = model.get_submodule(probe)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    seen, losses = {}, []
    layer.register_forward_hook(lambda m, args, output: seen.update(weight_in_forward=str(m.weight.dtype),
                                                                    output=str(output.dtype)))
    gen = torch.Generator().manual_seed(seed)
    log, saved = CollectiveLog(), SavedActivations()
    for step in range(steps):
        x, y = (t.to(device) for t in batch(generator=gen))
        with log if step == 0 else contextlib.nullcontext():
            with saved if step == 0 else contextlib.nullcontext():
                logits = model(x)
            loss = loss_of(logits, y)
            loss.backward()
        opt.step()
        if step == 0:
            state = model_state_bytes(model, opt)              # gradients still there: all three parts
            grad_dtype = str(layer.weight.grad.dtype)
            flat, target = logits.detach().flatten(0, 1), y.flatten()
            ce = {str(dtype): F.cross_entropy(flat.to(dtype), target).double().item()
                  for dtype in (torch.float64, torch.float32, flat.dtype)}
        opt.zero_grad()
        losses.append(loss.item())
    return {**seen, "sharded": str(layer.weight.dtype), "grad_dtype": grad_dtype, "collectives": log.summary(),
            "state": state, "activations": saved.bytes, "losses": losses, "logits_dtype": str(flat.dtype),
            "cross_entropy": ce}
