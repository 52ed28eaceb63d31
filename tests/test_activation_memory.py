"""Unit tests of helpers.activation_memory: counts compared with tensor sizes known in advance."""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from helpers.activation_memory import LiveTensorBytes, saved_tensor_bytes


def test_live_bytes_counts_new_tensors_and_their_frees():
    x = torch.ones(1000)  # existed before: not counted
    with LiveTensorBytes() as live:
        a = x * 2                      # 4000 bytes
        b = a + 1                      # 4000 more: peak 8000
        del a                          # freed
        c = b.view(10, 100)            # a view allocates nothing
        b.add_(1)                      # in place: nothing
        now = live.current
    assert live.peak == 8000
    assert now == 4000
    assert c.shape == (10, 100)


def test_live_bytes_peak_is_reached_inside_a_temporary():
    with LiveTensorBytes() as live:
        total = (torch.ones(256, 256) @ torch.ones(256, 256)).sum()  # two inputs + product alive together
    assert live.peak == 3 * 256 * 256 * 4
    assert live.current == total.element_size()  # only the 0-d result survives


def test_saved_tensor_bytes_of_known_ops():
    x = torch.randn(100, requires_grad=True)
    with saved_tensor_bytes() as saved:
        y = x.sin()  # sin saves its input
    assert saved["bytes"] == 400 and saved["tensors"] == 1
    y.sum().backward()


def test_checkpoint_keeps_only_its_input():
    layer = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32))
    x = torch.randn(64, 32, requires_grad=True)
    with saved_tensor_bytes() as plain:
        layer(x).sum()
    with saved_tensor_bytes() as ckpt:
        out = checkpoint(layer, x, use_reentrant=False)
    assert ckpt["bytes"] == x.numel() * 4  # the input, saved for the recomputation
    assert plain["bytes"] > ckpt["bytes"]
    out.sum().backward()
    assert x.grad is not None
