"""Checkpoints of the recipe (scripts/dcp_resume.py, made of notebook 06's cells) carry no rank- or device-specific
keys: one written at 2 ranks loads at 1 and at 3 with equal parameters and outputs, and one written by a GPU run
with extra per-rank, per-device entries (the layout that failed with "Missing key app.rank0.cuda_rng") loads on the
CPU. CPU only, real processes through helpers.launch."""
from __future__ import annotations

import gc
import re
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from helpers.devices import gpu_count
from helpers.launcher import launch
from helpers.devices import cpu_ranks_env
from helpers.paths import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
import dcp_resume as recipe  # noqa: E402

SIZE = dict(d_model=32, n_layers=1)


def _ranks(n):
    """launch's keywords for n ranks: GPUs hidden from ranks that outnumber them (they run on CPU and must not touch
    CUDA); on a one-GPU machine the single rank loads onto the GPU, so the checkpoint also crosses devices."""
    return dict(world_size=n, timeout=240, env=cpu_ranks_env(n, gpu_count()))


def _load_and_predict(folder):
    device = recipe.init_distributed()
    try:
        app = recipe.build(device, **SIZE)
        dcp.load({"app": app}, checkpoint_id=folder)
        app.model.eval()
        with torch.no_grad():
            logits = app.model(recipe.byte_windows()[0][0][None].to(device)).cpu()
        params = {k: v.full_tensor().cpu() for k, v in app.model.state_dict().items()}
        return {"params": params, "logits": logits, "step": app.step, "loader": app.loader.state_dict()}
    finally:
        gc.collect()
        dist.destroy_process_group()


def _save_with_gpu_era_keys(folder):
    # What the notebook's GPU run used to write: the app state plus per-rank RNG states, a CUDA one among them.
    device = recipe.init_distributed()
    try:
        app = recipe.build(device, **SIZE)
        state = app.state_dict()
        state[f"rank{dist.get_rank()}"] = {"torch_rng": torch.get_rng_state(),
                                           "cuda_rng": torch.zeros(16, dtype=torch.uint8)}
        dcp.save({"app": state}, checkpoint_id=folder)
        return {k: v.full_tensor().cpu() for k, v in app.model.state_dict().items()}
    finally:
        gc.collect()
        dist.destroy_process_group()


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(300)
def test_saved_at_two_ranks_loads_at_one_and_three_with_equal_outputs(tmp_path):
    saved = launch(recipe.train, str(tmp_path), total_steps=2, save_every=2, **SIZE, **_ranks(2))
    folder = recipe.latest(tmp_path)
    keys = list(dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)
    assert keys and not [k for k in keys if re.search(r"rank|cuda|cpu", k)], "no key names a rank or a device"
    one, three = (launch(_load_and_predict, str(folder), **_ranks(n)) for n in (1, 3))
    for loaded in (one[0], *three):
        assert loaded["step"] == 2 and _equal(loaded["params"], saved[0]["params"])
        # float32 kernels of two devices (1 rank on a GPU where there is one, 3 on CPUs) or thread counts sum in
        # other orders: about 1e-6 apart relative (TF32, about 1e-3, is off for CUDA matmuls by default)
        assert torch.allclose(loaded["logits"], one[0]["logits"], rtol=1e-4, atol=1e-5)
    assert all(r["loader"] == one[0]["loader"] for r in three), "the loader's position is the same on every rank"


@pytest.mark.timeout(300)
def test_a_checkpoint_with_extra_per_rank_device_keys_loads_without_them(tmp_path):
    params = launch(_save_with_gpu_era_keys, str(tmp_path), **_ranks(2))[0]
    meta = dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata
    assert "app.rank0.cuda_rng" in meta and "app.rank1.cuda_rng" in meta
    for n in (1, 3):
        loaded = launch(_load_and_predict, str(tmp_path), **_ranks(n))[0]
        assert _equal(loaded["params"], params), f"loaded at {n} ranks, extra entries ignored"


def test_the_old_failure_a_requested_key_the_checkpoint_lacks(tmp_path):
    # The cause of the GPU failure: a state that asks for a device-specific key the checkpoint never had.
    dcp.save({"app": {"w": torch.ones(3)}}, checkpoint_id=tmp_path, no_dist=True)
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: app.rank0.cuda_rng"):
        dcp.load({"app": {"w": torch.zeros(3), "rank0": {"cuda_rng": torch.zeros(16, dtype=torch.uint8)}}},
                 checkpoint_id=tmp_path, no_dist=True)


@pytest.mark.timeout(300)
def test_resumed_at_another_world_size_the_state_is_exact_and_the_trajectory_is_another(tmp_path):
    """What the recipe promises at another world size: the saved model, optimizer, schedule and step load exactly,
    so the evaluation loss on a fixed batch is the saved model's; the training that follows is another one (other
    data shards, another global batch, other dropout masks), so its losses differ from the uninterrupted run's."""
    import shutil

    uninterrupted = launch(recipe.train, str(tmp_path / "two"), total_steps=4, save_every=2, **SIZE, **_ranks(2))
    (tmp_path / "one").mkdir()
    shutil.copytree(tmp_path / "two" / "step_00000002", tmp_path / "one" / "step_00000002")
    saved = launch(_load_and_predict, str(tmp_path / "one" / "step_00000002"), **_ranks(2))[0]
    resumed = launch(_load_and_predict, str(tmp_path / "one" / "step_00000002"), **_ranks(1))[0]
    assert resumed["step"] == saved["step"] == 2 and _equal(resumed["params"], saved["params"])
    targets = recipe.byte_windows()[1][0][None]
    losses = [torch.nn.functional.cross_entropy(r["logits"].flatten(0, 1), targets.flatten()).item()
              for r in (saved, resumed)]
    assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[0]), f"the same evaluation loss at 1 and 2 ranks: {losses}"
    trained = launch(recipe.train, str(tmp_path / "one"), total_steps=4, save_every=2, **SIZE, **_ranks(1))[0]
    assert trained["resumed_from"] == 2 and sorted(trained["losses"]) == [3, 4]
    assert all(trained["losses"][s] != uninterrupted[0]["losses"][s] for s in (3, 4)), \
        "at another world size the steps after the resume train on other batches: other losses"
