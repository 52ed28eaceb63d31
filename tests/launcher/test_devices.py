"""helpers.devices decides which ranks get a GPU; these tests drive the GPU decisions on a CPU machine by handing
the decision the number of GPUs (CUDA itself is never faked), for a one-GPU machine and an eight-GPU one."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from helpers import devices


@pytest.fixture
def nccl_built(monkeypatch):
    """A CUDA build's answer (the CPU wheel has no NCCL); the launcher's own choice not set."""
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.delenv("COOKBOOK_BACKEND", raising=False)


@pytest.mark.parametrize("gpus, world, backend", [(1, 1, "nccl"), (1, 2, "gloo"), (8, 2, "nccl"), (8, 8, "nccl"),
                                                  (8, 16, "gloo"), (0, 1, "gloo")])
def test_nccl_only_when_every_local_rank_has_a_gpu_of_its_own(nccl_built, gpus, world, backend):
    assert devices.default_backend(world, gpus=gpus) == backend


def test_under_torchrun_the_local_world_size_decides(nccl_built, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert devices.default_backend(gpus=1) == "gloo"
    assert devices.default_backend(gpus=2) == "nccl"
    monkeypatch.setenv("COOKBOOK_BACKEND", "gloo")  # a worker of helpers.launch: the launcher already decided
    assert devices.default_backend(gpus=2) == "gloo"


def test_one_gpu_two_ranks_run_on_cpu_with_the_gpu_hidden_and_say_so():
    two = devices.placement(2, gpus=1)
    assert (two["on_gpus"], two["backend"], two["env"]) == (False, "gloo", devices.CPU_ONLY_ENV)
    assert "gloo on the CPU" in two["text"] and "1 GPU" in two["text"]
    one = devices.placement(1, gpus=1)
    assert (one["on_gpus"], one["backend"], one["env"]) == (True, "nccl", {})


def test_eight_gpus_give_each_rank_its_own_gpu_up_to_eight_ranks():
    for world in (2, 4, 8):
        assert devices.placement(world, gpus=8) | {"text": ""} == {"on_gpus": True, "backend": "nccl", "env": {},
                                                                 "text": ""}
    assert devices.placement(16, gpus=8)["env"] == devices.CPU_ONLY_ENV


def test_without_gpus_nothing_is_hidden():
    assert devices.placement(2, gpus=0) | {"text": ""} == {"on_gpus": False, "backend": "gloo", "env": {},
                                                         "text": ""}


@pytest.mark.parametrize("gpus, backend", [(1, "gloo"), (8, "nccl")])
def test_machine_facts_default_backend_is_for_the_default_world_size(nccl_built, monkeypatch, gpus, backend):
    """One GPU: the default 2 ranks share it, so gloo on the CPU; eight: one NCCL rank per GPU."""
    monkeypatch.setattr(devices, "gpu_count", lambda: gpus)
    monkeypatch.setattr(devices, "gpu_names", lambda: [])
    facts = devices.machine_facts()
    assert (facts["gpus"], facts["accelerator"], facts["default_backend"]) == (gpus, "cuda", backend)
