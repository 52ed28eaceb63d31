"""Checkpoints of the training recipe (scripts/train/checkpoint.py, made of notebook 06's cells) carry no rank- or
device-specific keys (each rank's generators travel in files beside the DCP state, restored only at the world size
that wrote them): one written at 2 ranks loads at 1 and at 3 with equal parameters, outputs and data position,
and one written by a GPU run with extra per-rank, per-device entries (the layout that failed with "Missing key
app.rank0.cuda_rng") loads on the CPU. CPU only, real processes through helpers.launch."""
from __future__ import annotations

import re
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from helpers.devices import cpu_ranks_env, gpu_count
from helpers.launcher import launch
from helpers.paths import SCRIPTS

sys.path.insert(0, str(SCRIPTS / "train"))  # the recipe's modules import each other by name; workers see this path
import checkpoint as recipe  # noqa: E402
import data  # noqa: E402

# the global batch (6) splits whole over 1, 2 and 3 ranks
TINY = ["--model=tiny", "--dim=32", "--n-layers=1", "--n-heads=2", "--seq-len=16", "--batch=6", "--lr=3e-3",
        "--dtype=fp32", "--no-compile", "--eval-windows=6", "--log-every=1"]   # the model named: GPUs default to another


@pytest.fixture
def flags(tmp_path):
    tokens = data.prepare([data.default_corpus_text()[:200_000]], tmp_path / "tokens.bin")
    return ["--data", str(tokens), *TINY]


def _ranks(n):
    """launch's keywords for n ranks: GPUs hidden from ranks that outnumber them (they run on CPU and must not touch
    CUDA); on a one-GPU machine the single rank loads onto the GPU, so the checkpoint also crosses devices."""
    return dict(world_size=n, timeout=240, env=cpu_ranks_env(n, gpu_count()))


def _train(flags):
    import train

    return train.run_distributed(train.train, train.parse_args(flags))


def _load_and_predict(folder, flags):
    import torch
    import torch.distributed.checkpoint as dcp

    import train

    def body(device):
        trainer = train.Trainer(train.parse_args(flags), device)
        dcp.load({"train": trainer.state}, checkpoint_id=folder)
        window = data.TokenWindows([data.load_tokens(p, "eval") for p in trainer.data.paths],
                                   trainer.job.seq_len)[0][0]
        with torch.no_grad():
            logits = trainer.model(window[None].to(device)).cpu()
        if trainer.job.dims.fsdp:
            trainer.model.reshard()
        params = {k: train.plain(v).cpu() for k, v in trainer.model.state_dict().items()}
        return {"params": params, "logits": logits, "step": trainer.state.step,
                "next": next(iter(trainer.data.loader))[0], "rng_restored": train.ckpt.load_rng(folder)}

    return train.run_distributed(body)


def _save_with_gpu_era_keys(folder, flags):
    # What the notebook's GPU run used to write: the training state plus per-rank RNG states, a CUDA one among them.
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import train

    def body(device):
        trainer = train.Trainer(train.parse_args(flags), device)
        state = trainer.state.state_dict()
        state[f"rank{dist.get_rank()}"] = {"torch_rng": torch.get_rng_state(),
                                           "cuda_rng": torch.zeros(16, dtype=torch.uint8)}
        dcp.save({"train": state}, checkpoint_id=folder)
        return {k: train.plain(v).cpu() for k, v in trainer.model.state_dict().items()}

    return train.run_distributed(body)


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(600)  # 25 s here, loaded
def test_saved_at_two_ranks_loads_at_one_and_three_with_equal_outputs_and_data_position(tmp_path, flags):
    launch(_train, [*flags, "--steps=2", "--save-every=2", f"--ckpt-dir={tmp_path / 'ckpt'}"], **_ranks(2))
    folder = recipe.latest(tmp_path / "ckpt")
    keys = list(dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)
    assert keys and not [k for k in keys if re.search(r"rank|cuda|cpu", k)], "no key names a rank or a device"
    assert len(list((folder / recipe.RNG_DIR).glob("rank*.pt"))) == 2, "each rank's generators beside the state"
    saved = torch.load(recipe.export(folder, tmp_path / "saved.pt"))["model"]  # the whole model, by one process
    one, three = (launch(_load_and_predict, str(folder), flags, **_ranks(n)) for n in (1, 3))
    for loaded in (one[0], *three):
        assert loaded["step"] == 2 and _equal(loaded["params"], saved)
        assert not loaded["rng_restored"], "generators saved at 2 ranks are not restored at another world size"
        # float32 kernels of two devices (1 rank on a GPU where there is one, 3 on CPUs) or thread counts sum in
        # other orders: about 1e-6 apart relative (TF32, about 1e-3, is off for CUDA matmuls by default)
        assert torch.allclose(loaded["logits"], one[0]["logits"], rtol=1e-4, atol=1e-5)
    assert torch.equal(one[0]["next"], torch.cat([r["next"] for r in three])), "the same next global batch"


@pytest.mark.timeout(600)  # 25 s here, loaded
def test_a_checkpoint_with_extra_per_rank_device_keys_loads_without_them(tmp_path, flags):
    params = launch(_save_with_gpu_era_keys, str(tmp_path / "ckpt"), flags, **_ranks(2))[0]
    meta = dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    assert "train.rank0.cuda_rng" in meta and "train.rank1.cuda_rng" in meta
    for n in (1, 3):
        loaded = launch(_load_and_predict, str(tmp_path / "ckpt"), flags, **_ranks(n))[0]
        assert _equal(loaded["params"], params), f"loaded at {n} ranks, extra entries ignored"


def test_the_old_failure_a_requested_key_the_checkpoint_lacks(tmp_path):
    # The cause of the GPU failure: a state that asks for a device-specific key the checkpoint never had.
    dcp.save({"app": {"w": torch.ones(3)}}, checkpoint_id=tmp_path, no_dist=True)
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: app.rank0.cuda_rng"):
        dcp.load({"app": {"w": torch.zeros(3), "rank0": {"cuda_rng": torch.zeros(16, dtype=torch.uint8)}}},
                 checkpoint_id=tmp_path, no_dist=True)
