"""Unit tests of helpers.measure.activations: counts compared with tensor sizes known in advance."""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from torch import nn

from helpers.measure.activations import LiveTensorBytes, SavedActivations


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


def test_saved_bytes_of_known_ops():
    x = torch.randn(100, requires_grad=True)  # a leaf that requires grad, not a parameter: an activation
    with SavedActivations() as saved:
        y = x.sin()  # sin saves its input
    assert saved.bytes == 400 and saved.tensors == 1 and saved.parameter_bytes == 0
    y.sum().backward()


def test_saved_activations_exclude_parameters():
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)
    x = torch.randn(16, 8)
    with SavedActivations() as meter:
        lin(x).relu().sum()
    # addmm saves its input for the weight gradient; relu saves its output; W.t() is not needed (x needs no grad)
    assert meter.bytes == 16 * 8 * 4 + 16 * 4 * 4
    assert meter.parameter_bytes == 0
    with SavedActivations() as meter:
        lin(x.requires_grad_()).relu().sum()
    assert meter.bytes == 16 * 8 * 4 + 16 * 4 * 4
    assert meter.parameter_bytes == 8 * 4 * 4, "W.t() is saved now, and counted as a parameter"


def test_checkpoint_keeps_only_its_input():
    layer = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32))
    x = torch.randn(64, 32, requires_grad=True)
    with SavedActivations() as plain:
        kept = layer(x).sum()
    with SavedActivations() as ckpt:
        out = checkpoint(layer, x, use_reentrant=False)
    # plain: x (for W1's gradient) and tanh's output (tanh's backward and W2's gradient share it); W1 and W2 too
    assert plain.bytes == 2 * x.numel() * 4 and plain.parameter_bytes == 2 * 32 * 32 * 4
    assert ckpt.bytes == x.numel() * 4  # the input, saved for the recomputation
    assert ckpt.parameter_bytes == 0, "the weights are used inside the checkpoint region only"
    kept.backward()
    out.sum().backward()
    assert x.grad is not None


def test_checkpointing_summary_states_the_removed_bytes_and_the_peaks():
    from helpers.measure.activations import checkpointing_summary

    mib = 2 ** 20
    ac = {"saved_bytes": {"none": 10 * mib, "full": 4 * mib}, "held_bytes": {"none": 10.5 * mib, "full": 4.5 * mib},
          "n_layers": 3, "one_block_saved": 2.5 * mib, "block_input_bytes": 0.5 * mib,
          "peak_label": "peak live tensors during one step", "peak_bytes": {"none": 12 * mib, "full": 7.25 * mib}}
    assert checkpointing_summary(ac).splitlines() == [
        "none       saved for backward   10.00 MiB, alive after forward   10.50 MiB, peak live tensors during one step"
        "   12.00 MiB",
        "full       saved for backward    4.00 MiB, alive after forward    4.50 MiB, peak live tensors during one step"
        "    7.25 MiB",
        "full checkpointing removes exactly 3 x (one block's 2.50 MiB - its 0.50 MiB input)"]
