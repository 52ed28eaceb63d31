"""Gradient codecs for a parameter server: what a trainer puts on the wire, and what that costs in bytes.

Why a module: notebook 04 sends gradients over RPC uncompressed, as fp16, and top-k sparsified with error
feedback, and asserts that the bytes it counted match the arithmetic. The codecs are small enough to read in full
(the notebook prints `TopKCodec`'s source); keeping them here lets the unit tests pin their invariants:

- fp32: 4 bytes a value; fp16: 2 bytes a value (quantisation, no state).
- top-k: per tensor the k = ceil(ratio * numel) largest-magnitude entries, sent as int32 index + fp32 value
  (8 bytes each). With error feedback the trainer keeps what it did not send and adds it to the next gradient,
  so nothing is lost, only delayed: sum(sent) + residual == sum(gradients), exactly (up to float addition).

A payload is a list with one self-describing entry per tensor, so the server decodes without knowing the codec.
Each codec also answers `decode(payload)` and `nbytes(payload)`, so a worker that is handed a codec needs nothing
else from this module (notebook 04's workers take the codec as an argument and import no helpers).
"""
from __future__ import annotations

import math

import torch


def payload_bytes(payload: list) -> int:
    """Bytes of tensor data in a payload (what the trainer uploads per update, headers not counted)."""
    total = 0
    for entry in payload:
        for part in entry[1:]:
            if isinstance(part, torch.Tensor):
                total += part.numel() * part.element_size()
    return total


def decode(payload: list) -> list[torch.Tensor]:
    """Dense fp32 gradients from any codec's payload."""
    grads = []
    for entry in payload:
        kind = entry[0]
        if kind == "dense":
            grads.append(entry[1].float())
        elif kind == "sparse":
            _, index, values, shape = entry
            dense = torch.zeros(math.prod(shape), dtype=values.dtype)
            dense[index.long()] = values
            grads.append(dense.view(shape))
        else:
            raise ValueError(f"unknown payload entry {kind!r}")
    return grads


class DenseCodec:
    """Every value, cast to `dtype`: fp32 sends 4 bytes a value (exact), fp16 2 bytes a value (relative rounding
    error at most 2**-11 for values in fp16's range)."""

    NAMES = {torch.float32: "fp32", torch.float16: "fp16"}
    decode = staticmethod(decode)
    nbytes = staticmethod(payload_bytes)

    def __init__(self, dtype: torch.dtype = torch.float32):
        if dtype not in self.NAMES:
            raise ValueError(f"dense codecs send {sorted(self.NAMES.values())}, not {dtype}")
        self.dtype, self.name = dtype, self.NAMES[dtype]

    def encode(self, grads: list[torch.Tensor]) -> list:
        return [("dense", g.detach().cpu().to(self.dtype)) for g in grads]

    def expected_bytes(self, shapes: list[tuple[int, ...]]) -> int:
        return self.dtype.itemsize * sum(math.prod(s) for s in shapes)


class TopKCodec:
    """Send the k largest-magnitude entries of each gradient (int32 index + fp32 value); keep the rest as error."""

    decode = staticmethod(decode)
    nbytes = staticmethod(payload_bytes)

    def __init__(self, ratio: float, error_feedback: bool = True):
        if not 0 < ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {ratio}")
        self.ratio, self.error_feedback = ratio, error_feedback
        self.residual: list[torch.Tensor] | None = None
        self.name = f"top-{ratio:.0%}" + (" + error feedback" if error_feedback else "")

    def k(self, numel: int) -> int:
        return max(1, math.ceil(self.ratio * numel))

    def encode(self, grads: list[torch.Tensor]) -> list:
        grads = [g.detach().cpu().float() for g in grads]
        if self.error_feedback and self.residual is None:
            self.residual = [torch.zeros_like(g) for g in grads]
        payload = []
        for i, g in enumerate(grads):
            corrected = g + self.residual[i] if self.error_feedback else g
            flat = corrected.flatten()
            index = flat.abs().topk(self.k(flat.numel())).indices
            values = flat[index]
            if self.error_feedback:
                remaining = flat.clone()
                remaining[index] = 0  # what was sent is no longer owed
                self.residual[i] = remaining.view_as(g)
            payload.append(("sparse", index.to(torch.int32), values, tuple(g.shape)))
        return payload

    def expected_bytes(self, shapes: list[tuple[int, ...]]) -> int:
        return 8 * sum(self.k(math.prod(s)) for s in shapes)


def make_codec(spec: str):
    """'fp32', 'fp16', 'topk:0.01' (with error feedback) or 'topk-noef:0.01' (without)."""
    if spec == "fp32":
        return DenseCodec(torch.float32)
    if spec == "fp16":
        return DenseCodec(torch.float16)
    kind, _, ratio = spec.partition(":")
    if kind in ("topk", "topk-noef") and ratio:
        return TopKCodec(float(ratio), error_feedback=(kind == "topk"))
    raise ValueError(f"unknown codec {spec!r}: use 'fp32', 'fp16', 'topk:<ratio>' or 'topk-noef:<ratio>'")
