"""Unit tests of the small foundation helpers: each checks a closed form or an exact round trip."""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from helpers import data
from helpers.measure import memory
from helpers.measure.headline import MIMETYPE, headlines_of
from helpers.cluster.torchrun import torchrun_lines

from helpers.paths import SCRIPTS

if str(SCRIPTS / "train") not in sys.path:  # the recipe's Llama (scripts/train/model.py), imported as notebooks do
    sys.path.insert(0, str(SCRIPTS / "train"))


@pytest.mark.parametrize("stage,expected", [(0, 16.0), (1, 4 + 4 + 8 / 4), (2, 4 + 4 / 4 + 8 / 4), (3, 16 / 4)])
def test_zero_bytes_fp32_adam(stage, expected):
    per_rank = memory.zero_bytes_per_rank(1_000, world_size=4, stage=stage)
    assert sum(per_rank.values()) == pytest.approx(expected * 1_000)


def test_zero_bytes_mixed_precision_is_16_bytes_per_parameter_unsharded():
    assert sum(memory.zero_bytes_per_rank(10, 8, stage=0, mixed_precision=True).values()) == 160
    assert sum(memory.zero_bytes_per_rank(10, 8, stage=3, mixed_precision=True).values()) == 20
    with pytest.raises(ValueError):
        memory.zero_bytes_per_rank(10, 2, stage=4)


def test_model_state_bytes_counts_adam_moments_but_not_the_step_counter():
    model = torch.nn.Linear(10, 5)  # 55 parameters
    opt = torch.optim.Adam(model.parameters())
    assert memory.model_state_bytes(model, opt) == {"parameters": 220, "gradients": 0, "optimizer": 0}
    model(torch.randn(3, 10)).sum().backward()
    opt.step()
    assert memory.model_state_bytes(model, opt) == {"parameters": 220, "gradients": 220, "optimizer": 440}


def test_headlines_are_read_back_from_an_executed_notebook():
    nb = {"cells": [{"cell_type": "code", "outputs": [
        {"output_type": "display_data", "data": {"text/plain": "x: 1", MIMETYPE: {"name": "x", "value": 1.0,
                                                                                  "unit": "s"}}},
        {"output_type": "stream", "text": "noise"}]}, {"cell_type": "markdown"}]}
    assert headlines_of(nb) == [{"name": "x", "value": 1.0, "unit": "s"}]


def test_torchrun_lines_use_c10d_without_node_rank_and_show_slurm():
    lines = torchrun_lines("s.py", nproc="4")
    assert "--standalone --nproc-per-node=4 s.py" in lines
    multi = [line for line in lines.splitlines() if line.startswith("torchrun --nnodes")]
    assert len(multi) == 1 and "--rdzv-backend=c10d" in multi[0] and "--node-rank" not in lines
    assert any(line.startswith("srun ") and "$SLURM_JOB_ID" in line for line in lines.splitlines())


def test_digits_split_is_real_and_reproducible():
    train, test = data.load_digits()
    assert (len(train), len(test)) == (1438, 359)
    assert train.x.shape[1] == 64 and 0.0 <= float(train.x.min()) and float(train.x.max()) <= 1.0
    assert set(train.y.tolist()) == set(range(10))
    again, _ = data.load_digits()
    assert torch.equal(train.y, again.y)


def test_the_digits_file_holds_the_uci_test_set_as_scikit_learn_ships_it():
    """data/digits.npz is the 1,797-row UCI test set, row for row (where scikit-learn is installed to compare)."""
    import numpy as np

    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    bunch = sklearn_datasets.load_digits()
    with np.load(data.DIGITS) as saved:
        assert saved["images"].shape == (1797, 8, 8) and saved["labels"].shape == (1797,)
        assert np.array_equal(saved["images"].reshape(1797, 64), bunch.data)
        assert np.array_equal(saved["labels"], bunch.target)


def test_text_tokenizer_round_trips_the_corpus():
    tokens, tok = data.text_tokens()
    assert len(tokens) > 400_000
    assert tok.decode(tokens[:500]) == data.load_text()[:500]
    x, y = data.text_batch(tokens, 3, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (3, 16) and torch.equal(x[:, 1:], y[:, :-1])


def test_the_recipes_llama_starts_near_uniform_loss_on_the_text_data():
    import torch.nn.functional as F
    from model import Llama, LlamaArgs

    tokens, tok = data.text_tokens()
    model = Llama(LlamaArgs(vocab_size=tok.vocab_size, dim=64, n_layers=2, n_heads=2, max_seq_len=32))
    model.init_weights(seed=0)
    x, y = data.text_batch(tokens, 8, 32, torch.Generator().manual_seed(0))
    logits = model(x)
    assert logits.shape == (8, 32, tok.vocab_size)
    assert abs(F.cross_entropy(logits.flatten(0, 1), y.flatten()).item() - math.log(tok.vocab_size)) < 0.5


def test_each_ranks_lines_also_go_to_its_own_panel():
    import io

    from helpers.launcher.output import RankPanels, RankStream

    panels = RankPanels(2)
    merged = io.StringIO()
    streams = {}
    for rank in (0, 1):
        read, write = os.pipe()
        streams[rank] = (RankStream(read, rank, merged, keep_tail=rank == 1, panels=panels), write)
    panels.shown = True  # no front end in a test: skip IPython's display
    os.write(streams[0][1], b"step 1\nstep 2\n")
    os.write(streams[1][1], b"warning from rank 1\n")
    for stream, write in streams.values():
        os.close(write)
        stream.finish()
    assert merged.getvalue() == "[rank 0] step 1\n[rank 0] step 2\n[rank 1] warning from rank 1\n"
    rank0 = "".join(o["text"] for o in panels.outputs[0].outputs)
    rank1 = [(o["name"], o["text"]) for o in panels.outputs[1].outputs]
    assert rank0 == "step 1\nstep 2\n" and rank1 == [("stderr", "warning from rank 1\n")]
    assert [panels.widget.get_title(r) for r in (0, 1)] == ["rank 0", "rank 1"]


@pytest.mark.parametrize("built, counted, expected", [(True, 2, 2), (True, 0, 0), (False, 3, 0)])
def test_gpu_count_is_torchs_public_count_and_zero_without_cuda(monkeypatch, built, counted, expected):
    """torch.cuda.device_count() asks NVML first (no CUDA context) and the CUDA runtime only where NVML cannot
    answer (PyPI's CUDA build without a driver); a torch built without CUDA has no GPU to count."""
    from helpers import devices

    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: built)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: counted)
    assert devices.gpu_count() == expected


def test_counting_gpus_creates_no_cuda_context():
    """The kernel asks how many GPUs there are and must stay safe to describe the machine from: no context."""
    import subprocess
    import sys

    probe = subprocess.run([sys.executable, "-c", "import torch; from helpers import devices; devices.gpu_count(); "
                            "print(torch.cuda.is_initialized())"], capture_output=True, text=True, timeout=600)
    assert probe.stdout.strip() == "False", probe.stdout + probe.stderr
