"""Unit tests of helpers.checkpoint_commit with real DCP checkpoints (one process, no process group)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from helpers import checkpoint_commit as cc


def save_step(root, step, value):
    dcp.save({"w": torch.full((4,), float(value))}, checkpoint_id=cc.staging_dir(root, step), no_dist=True)


def load(path):
    state = {"w": torch.zeros(4)}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state["w"]


def test_commit_publishes_and_latest_finds_it(tmp_path):
    assert cc.latest(tmp_path) is None
    save_step(tmp_path, 10, 1.0)
    assert cc.latest(tmp_path) is None, "a staged checkpoint is invisible until committed"
    cc.commit(tmp_path, 10)
    assert cc.latest(tmp_path) == cc.step_dir(tmp_path, 10)
    assert torch.equal(load(cc.latest(tmp_path)), torch.full((4,), 1.0))


def test_an_unfinished_save_is_never_latest(tmp_path):
    save_step(tmp_path, 5, 5.0)
    cc.commit(tmp_path, 5)
    save_step(tmp_path, 6, 6.0)
    (cc.staging_dir(tmp_path, 6) / ".metadata").unlink()  # as if the writer died before finishing
    with pytest.raises(FileNotFoundError):
        cc.commit(tmp_path, 6)
    assert cc.committed_steps(tmp_path) == [5]
    assert torch.equal(load(cc.latest(tmp_path)), torch.full((4,), 5.0))
    assert cc.clear_staging(tmp_path) == [cc.staging_dir(tmp_path, 6)]
    assert not cc.staging_dir(tmp_path, 6).exists()


def test_keep_last_k(tmp_path):
    for step in (1, 2, 3, 4, 5):
        save_step(tmp_path, step, step)
        cc.commit(tmp_path, step, keep=2)
    assert cc.committed_steps(tmp_path) == [4, 5]
    assert cc.prune(tmp_path, 1) == [4]
    with pytest.raises(ValueError):
        cc.prune(tmp_path, 0)


def test_a_step_commits_once(tmp_path):
    save_step(tmp_path, 7, 7.0)
    cc.commit(tmp_path, 7)
    save_step(tmp_path, 7, 8.0)
    with pytest.raises(FileExistsError):
        cc.commit(tmp_path, 7)
    assert torch.equal(load(cc.latest(tmp_path)), torch.full((4,), 7.0))


def test_a_folder_without_metadata_is_not_committed(tmp_path):
    (tmp_path / "step_00000009").mkdir()  # looks committed, is not a checkpoint
    assert cc.committed_steps(tmp_path) == []
