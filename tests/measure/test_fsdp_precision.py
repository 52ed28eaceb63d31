"""The activation meter of notebook 03b's mixed-precision check: saved bytes split by dtype, each storage once."""
from __future__ import annotations

import torch


def test_saved_bytes_by_dtype_add_up_to_the_total_and_leave_parameters_out():
    from helpers.measure.fsdp import SavedByDtype

    layer = torch.nn.Linear(8, 16, bias=False).to(torch.bfloat16)
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    with SavedByDtype() as meter:
        h = layer(x)                      # saves x (bf16) and the weight (a parameter: not counted)
        (h.float() ** 2).sum()            # the upcast saves nothing; pow saves its fp32 input
    assert meter.by_dtype == {"torch.float32": 4 * 16 * 4, "torch.bfloat16": 4 * 8 * 2}
    assert sum(meter.by_dtype.values()) == meter.bytes
    assert list(meter.by_dtype) == ["torch.float32", "torch.bfloat16"], "largest first"
