"""The commit protocol of the training recipe (scripts/train/checkpoint.py, made of notebook 06's cells, and imported
by notebook 09's scripts/cluster_ddp.py), with real DCP checkpoints in one process: a save becomes visible only once
complete, a crash during a save leaves the previous checkpoint the one that loads, and only the newest `keep`
stay."""
from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from helpers.paths import SCRIPTS

sys.path.insert(0, str(SCRIPTS / "train"))  # the recipe's modules import each other by name, as train.py does
import checkpoint as recipe  # noqa: E402


def save_step(root, step, value):
    dcp.save({"w": torch.full((4,), float(value))}, checkpoint_id=recipe.staging_dir(root, step), no_dist=True)


def load(path):
    state = {"w": torch.zeros(4)}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state["w"]


def test_commit_publishes_and_latest_finds_it(tmp_path):
    assert recipe.latest(tmp_path) is None
    save_step(tmp_path, 10, 1.0)
    assert recipe.latest(tmp_path) is None, "a staged checkpoint is invisible until committed"
    recipe.commit(tmp_path, 10)
    assert recipe.latest(tmp_path) == tmp_path / "step_00000010"
    assert torch.equal(load(recipe.latest(tmp_path)), torch.full((4,), 1.0))


def test_an_unfinished_save_is_never_latest(tmp_path):
    save_step(tmp_path, 5, 5.0)
    recipe.commit(tmp_path, 5)
    save_step(tmp_path, 6, 6.0)
    (recipe.staging_dir(tmp_path, 6) / ".metadata").unlink()  # as if a writer died before the save finished
    with pytest.raises(FileNotFoundError):
        recipe.commit(tmp_path, 6)
    assert recipe.latest(tmp_path) == tmp_path / "step_00000005"
    assert torch.equal(load(recipe.latest(tmp_path)), torch.full((4,), 5.0))


def test_keep_last_k_and_the_newest_is_latest(tmp_path):
    for step in (1, 2, 3, 12, 100):
        save_step(tmp_path, step, step)
        recipe.commit(tmp_path, step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000012", "step_00000100"]
    assert torch.equal(load(recipe.latest(tmp_path)), torch.full((4,), 100.0))


def test_a_step_saved_again_replaces_the_committed_one(tmp_path):
    # a rerun of a finished run saves its last step again: the new save wins, and it stays one checkpoint
    save_step(tmp_path, 7, 7.0)
    recipe.commit(tmp_path, 7)
    save_step(tmp_path, 7, 8.0)
    recipe.commit(tmp_path, 7)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000007"]
    assert torch.equal(load(recipe.latest(tmp_path)), torch.full((4,), 8.0))


def test_commit_writes_the_runs_configuration_beside_the_data_when_given(tmp_path):
    save_step(tmp_path, 3, 3.0)
    path = recipe.commit(tmp_path, 3, keep=2, config={"model": {"dim": 32}})
    assert path == tmp_path / "step_00000003"
    assert json.loads((path / recipe.CONFIG_FILE).read_text()) == {"model": {"dim": 32}}
    save_step(tmp_path, 4, 4.0)
    assert not (recipe.commit(tmp_path, 4) / recipe.CONFIG_FILE).exists(), "no configuration, no file"


def test_a_folder_without_metadata_is_not_latest(tmp_path):
    (tmp_path / "step_00000009").mkdir()  # looks committed, is not a checkpoint
    assert recipe.latest(tmp_path) is None


class _DyingWriter(dcp.FileSystemWriter):
    """DCP's writer, except that the process "dies" (raises) half-way through writing its data."""

    def write_data(self, plan, planner):
        (self.path / "__0_0.distcp").write_bytes(b"half a shard")  # some bytes reached the disk
        raise RuntimeError("killed while writing")


def test_a_crash_during_a_save_leaves_the_previous_checkpoint_the_one_that_loads(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    save_step(tmp_path, 10, 10.0)
    recipe.commit(tmp_path, 10)
    with pytest.raises(CheckpointException, match="killed while writing"):
        dcp.save({"w": torch.full((4,), 20.0)}, storage_writer=_DyingWriter(recipe.staging_dir(tmp_path, 20)),
                 no_dist=True)
    assert (recipe.staging_dir(tmp_path, 20) / "__0_0.distcp").exists(), "the torn save is on disk"
    assert recipe.latest(tmp_path) == tmp_path / "step_00000010"
    assert torch.equal(load(recipe.latest(tmp_path)), torch.full((4,), 10.0))
    recipe.clear_staging(tmp_path)  # what the next run does before it saves
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000010"]


def test_the_cluster_script_commits_with_the_same_protocol():
    sys.path.insert(0, str(SCRIPTS))
    import cluster_ddp

    for name in ("staging_dir", "commit", "latest", "clear_staging"):
        assert getattr(cluster_ddp, name) is getattr(recipe, name), f"cluster_ddp.py has its own {name}"


def test_an_async_save_is_committed_by_poll_once_written_and_not_before(tmp_path, monkeypatch):
    """`Checkpointer.poll()`, called every step by train.py: a crash between two saves loses only the steps since
    the last one written, not a save that finished in the background but waited for the next save to commit."""
    from concurrent.futures import Future

    monkeypatch.setattr(recipe.dist, "get_rank", lambda: 0)  # rank 0 commits; no process group needed for that
    checkpointer = object.__new__(recipe.Checkpointer)       # its __init__ makes a gloo group: not needed here
    checkpointer.root, checkpointer.keep, checkpointer.config = tmp_path, 2, {}
    save_step(tmp_path, 4, 4.0)
    written = Future()
    checkpointer.pending = (written, 4)
    checkpointer.poll()
    assert recipe.latest(tmp_path) is None and checkpointer.pending is not None, "still being written: not committed"
    written.set_result(None)
    checkpointer.poll()
    assert recipe.latest(tmp_path) == tmp_path / "step_00000004" and checkpointer.pending is None
    assert torch.equal(load(recipe.latest(tmp_path)), torch.full((4,), 4.0))
