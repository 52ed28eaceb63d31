"""Bytes per rank: storages (padding and shared buffers), ZeRO's arithmetic."""
from __future__ import annotations

import torch
from torch import nn

from helpers.measure.memory import (CUDA_BLOCK_BYTES, allocated_state_bytes, cuda_memory, model_state_bytes, storage_bytes,
                            zero_bytes_per_rank)


def test_storage_bytes_counts_each_storage_once_and_rounds():
    base = torch.zeros(100)
    views = [base[:10], base[10:], base.view(10, 10)]
    assert storage_bytes(views) == 400
    assert storage_bytes(views + [torch.zeros(3), None]) == 412
    assert storage_bytes([torch.zeros(3)], round_to=CUDA_BLOCK_BYTES) == 512
    assert storage_bytes([torch.zeros(129)], round_to=CUDA_BLOCK_BYTES) == 1024


def test_allocated_equals_held_for_a_plain_model_with_adam():
    model = nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    held = model_state_bytes(model, opt)
    assert held == {"parameters": 36 * 4, "gradients": 36 * 4, "optimizer": 36 * 8}
    assert allocated_state_bytes(model, opt) == held
    zero = zero_bytes_per_rank(36, 1, stage=0)
    assert held == {k: int(v) for k, v in zero.items()}


def test_cuda_memory_is_none_off_cuda():
    assert cuda_memory("cpu") is None


def test_step_memory_of_a_plain_model_is_zeros_16_psi_and_its_saved_activations():
    from helpers.measure.memory import step_memory

    torch.manual_seed(0)
    x = torch.randn(5, 8)
    got = step_memory(lambda: nn.Sequential(nn.Linear(8, 4), nn.ReLU()), lambda m: m(x).sum(), "cpu")
    assert got["allocated"] == got["held"] == {"parameters": 36 * 4, "gradients": 36 * 4, "optimizer": 36 * 8}
    assert got["activations"] == 5 * 8 * 4 + 5 * 4 * 4  # the Linear's input, the ReLU's output
    assert got["whole_parameters"] == 0 and "cuda" not in got
