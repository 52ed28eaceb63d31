"""Bytes per rank: storages (padding and shared buffers), ZeRO's arithmetic."""
from __future__ import annotations

import sys

import torch
from torch import nn

from helpers.measure.memory import (CUDA_BLOCK_BYTES, allocated_state_bytes, cuda_memory, model_state_bytes, storage_bytes,
                            zero_bytes_per_rank)

from helpers.paths import SCRIPTS

if str(SCRIPTS / "train") not in sys.path:  # the recipe's Llama (scripts/train/model.py), imported as notebooks do
    sys.path.insert(0, str(SCRIPTS / "train"))


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


def _step_memory_worker(vocab):
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from helpers.measure.memory import step_memory
    import torch.nn.functional as F
    from model import Llama, LlamaArgs

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    config = LlamaArgs(vocab_size=vocab, dim=32, n_layers=2, n_heads=2, max_seq_len=8)
    x = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))

    def build(reshard):
        torch.manual_seed(0)
        model = Llama(config)
        if reshard == "plain":
            return model
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        kwargs = {} if reshard is None else {"reshard_after_forward": reshard}
        for block in model.layers.values():
            fully_shard(block, mesh=mesh, **kwargs)
        return fully_shard(model, mesh=mesh, **kwargs)

    try:
        out = {r: step_memory(lambda r=r: build(r), lambda m: F.cross_entropy(m(x).flatten(0, 1), x.flatten()), "cpu")
               for r in ("plain", None, False, True)}
        with torch.device("meta"):
            model = Llama(config)
        out["numel"] = {"all": sum(p.numel() for p in model.parameters()),
                        "blocks": sum(p.numel() for p in model.layers.parameters())}
        return out
    finally:
        dist.destroy_process_group()


def test_whole_parameters_between_forward_and_backward_follow_reshard_after_forward():
    import helpers

    for r in helpers.launch(_step_memory_worker, 11, world_size=2, timeout=120, quiet=True):
        psi, blocks = r["numel"]["all"], r["numel"]["blocks"]
        assert r["plain"]["whole_parameters"] == 0, "an unsharded model's parameters are its state"
        assert r[None]["whole_parameters"] == 4 * (psi - blocks), "default: only the root stays gathered"
        assert r[False]["whole_parameters"] == 4 * psi, "reshard_after_forward=False: every group stays gathered"
        assert r[True]["whole_parameters"] == 0, "reshard_after_forward=True: nothing stays gathered"
        assert r[None]["activations"] == r["plain"]["activations"], "sharding leaves activations alone"
