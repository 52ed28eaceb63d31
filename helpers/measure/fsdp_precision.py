"""What a `MixedPrecisionPolicy` changes, seen from inside one rank: dtypes, bytes on the wire, state, activations.

Why a module: notebook 03b claims that a bf16 `param_dtype` all-gathers and computes in bf16 while the sharded
parameters, their gradients and Adam's state stay fp32 (so the persistent bytes per rank do not change), that
`reduce_dtype=torch.float32` reduce-scatters in fp32, and that a loss taken on `logits.float()` loses nothing
against float64. Checking that takes a forward hook on one layer, a collective log and an activation meter around
the first step, the state after it, and the loss of the same logits computed three ways: measuring machinery, not
what a reader copies (the policy itself is one line where the model is built). Runs in a worker.

The activations are also split by dtype: not every op computes in the policy's dtype (RMSNorm upcasts to fp32, and
where it runs as separate ops, as on the CPU, autograd saves its fp32 intermediates), so what shrinks to half is
the bf16 part, which the split shows.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from helpers.measure.activations import SavedActivations
from helpers.measure.comm_log import CollectiveLog
from helpers.measure.memory import model_state_bytes


class SavedByDtype(SavedActivations):
    """`SavedActivations` that also sums the saved bytes per dtype (`by_dtype`), each storage counted once."""

    def __init__(self):
        super().__init__()
        self._dtypes: dict[int, str] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        local = t
        if callable(getattr(t, "to_local", None)):  # a DTensor: its storage is the local shard's
            with torch.no_grad():
                local = t.to_local()
        try:
            key = local.untyped_storage().data_ptr()
        except RuntimeError:  # a storage Python cannot read: SavedActivations keys it by id, as here
            key = id(t)
        self._dtypes[key] = str(t.dtype)
        return super()._pack(t)

    @property
    def by_dtype(self) -> dict[str, int]:
        """{dtype: bytes} of the activations saved (parameters excluded), largest first."""
        out: dict[str, int] = {}
        for key, nbytes in self._activations.items():
            out[self._dtypes[key]] = out.get(self._dtypes[key], 0) + nbytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def precision_report(model, probe: str, loss_of, batch, steps: int, lr: float, device, seed: int) -> dict:
    """Train `model` `steps` Adam steps on `batch(generator=g)` batches and report what its precision policy did.

    `probe` names a Linear inside the model (e.g. "layers.0.feed_forward.w1"): the dtypes of its weight in forward,
    its output, its sharded weight and its gradient. The first step is measured: collectives
    (`CollectiveLog.summary()`), activations saved for backward (in all and per dtype), model state bytes after the
    optimizer step, and the cross-entropy of its logits in float64, float32 and the logits' own dtype. Returns plain
    values.
    """
    layer = model.get_submodule(probe)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    seen, losses = {}, []
    layer.register_forward_hook(lambda m, args, output: seen.update(weight_in_forward=str(m.weight.dtype),
                                                                    output=str(output.dtype)))
    gen = torch.Generator().manual_seed(seed)
    log, saved = CollectiveLog(), SavedByDtype()
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
            "state": state, "activations": saved.bytes, "activations_by_dtype": saved.by_dtype, "losses": losses,
            "logits_dtype": str(flat.dtype), "cross_entropy": ce}
