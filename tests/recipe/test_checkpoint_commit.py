"""The commit protocol of the training recipe (scripts/train/checkpoint.py, made of notebook 06's cells, and imported
by notebook 09's scripts/cluster_ddp.py), with real DCP checkpoints in one process: a save becomes visible only once
complete, a crash during a save or a commit leaves a committed checkpoint the one that loads, only the newest `keep`
stay, everything is fsynced, start-up settles the staged saves it finds by one rule whatever job left them; and
with real processes (helpers.launch): every rank loads the checkpoint rank 0 picks, or all refuse with one line."""
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


def test_a_step_committed_already_stays_and_its_duplicate_is_dropped(tmp_path):
    # a step saved again (a second job in the directory, a rerun): the committed one is never deleted to make room
    save_step(tmp_path, 7, 7.0)
    recipe.commit(tmp_path, 7)
    save_step(tmp_path, 7, 8.0)
    assert recipe.commit(tmp_path, 7) == tmp_path / "step_00000007"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000007"], "the duplicate's staging folder is gone"
    assert torch.equal(load(recipe.latest(tmp_path)), torch.full((4,), 7.0))


def test_a_crash_in_a_commit_leaves_a_committed_checkpoint_that_loads(tmp_path, monkeypatch):
    """The old commit deleted an existing step_N, then renamed: a crash between the two (simulated: the rename
    raises) lost the newest checkpoint. Now nothing committed is deleted before a newer one is committed."""
    def crash(*args):
        raise OSError("killed between the delete and the rename")

    save_step(tmp_path, 7, 7.0)
    recipe.commit(tmp_path, 7, keep=1)
    for step, value in ((7, 8.0), (9, 9.0)):          # the same step again; a newer step with keep=1
        save_step(tmp_path, step, value)
        with monkeypatch.context() as m:
            m.setattr(recipe.os, "rename", crash)
            try:
                recipe.commit(tmp_path, step, keep=1)
            except OSError:
                pass
        assert recipe.latest(tmp_path) == tmp_path / "step_00000007", f"after the crash committing step {step}"
        assert torch.equal(load(recipe.latest(tmp_path)), torch.full((4,), 7.0))


def test_keep_must_be_at_least_one(tmp_path):
    # `[:-0]` kept everything and a negative keep deleted the newest
    save_step(tmp_path, 1, 1.0)
    for keep in (0, -1):
        with pytest.raises(ValueError, match="keep must be at least 1"):
            recipe.commit(tmp_path, 1, keep=keep)
    assert recipe.latest(tmp_path) is None and recipe.staging_dir(tmp_path, 1).exists(), "nothing done"


def test_a_commit_fsyncs_the_files_the_folder_and_its_parent(tmp_path, monkeypatch):
    import os

    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(recipe.os, "fsync", fsync)
    save_step(tmp_path, 3, 3.0)
    staged = recipe.staging_dir(tmp_path, 3)
    recipe.commit(tmp_path, 3, config={"model": {}})
    assert {str(staged / ".metadata"), str(staged / recipe.CONFIG_FILE), str(staged), str(tmp_path)} <= set(synced)


def _stage(root, step, job, ranks=1, config=None):
    """A save of `step` by `job` as the Checkpointer stages it: each rank's generator file, the run's configuration,
    the DCP data and .metadata (written last); not committed."""
    folder = recipe.staging_dir(root, step, job)
    for rank in range(ranks):
        (folder / recipe.RNG_DIR).mkdir(parents=True, exist_ok=True)
        torch.save({"world_size": ranks, "cpu": torch.get_rng_state()}, folder / recipe.RNG_DIR / f"rank{rank:05d}.pt")
    if config is not None:
        recipe.write_config(folder, config)
    dcp.save({"w": torch.full((4,), float(step))}, checkpoint_id=folder, no_dist=True)
    return folder


def _age(folder, seconds):
    """Every file of `folder` last changed `seconds` ago."""
    import os
    import time

    for path in [folder, *folder.rglob("*")]:
        os.utime(path, (time.time() - seconds, time.time() - seconds))


def test_start_up_settles_every_staged_save_by_one_rule_whatever_job_left_it(tmp_path):
    """A --standalone relaunch is a new job ("new"). Its predecessor ("old") left a complete save of step 4 that it
    never renamed, a save of step 6 torn 20 minutes ago, a step 12 whose rank 1 never wrote its files, a step 14
    whose data file was cut short; a live job is writing step 8 now; "new"'s own earlier attempt tore step 10.
    Start-up commits step 4 alone, with the configuration it was saved with, leaves the live save, deletes the rest."""
    stale = 2 * recipe.LEASE_S
    _stage(tmp_path, 4, "old", ranks=2, config={"saved by": "old"})
    torn = [_stage(tmp_path, 6, "old"), _stage(tmp_path, 8, "live"), _stage(tmp_path, 10, "new")]
    for folder in torn:
        (folder / ".metadata").unlink()
    (_stage(tmp_path, 12, "old", ranks=2) / recipe.RNG_DIR / "rank00001.pt").unlink()
    short = next(_stage(tmp_path, 14, "old").glob("*.distcp"))
    short.write_bytes(short.read_bytes()[:-1])
    for step in (6, 12, 14):
        _age(recipe.staging_dir(tmp_path, step, "old"), stale)
    left = recipe.settle_staging(tmp_path, keep=5, config={"saved by": "new"}, job="new")
    assert left == [recipe.staging_dir(tmp_path, 8, "live")] and (left[0] / "rng").exists(), "a live save, untouched"
    assert sorted(p.name for p in tmp_path.iterdir()) == [left[0].name, "step_00000004"], "the rest deleted"
    assert torch.equal(load(recipe.latest(tmp_path)), torch.full((4,), 4.0))
    assert json.loads((tmp_path / "step_00000004" / recipe.CONFIG_FILE).read_text()) == {"saved by": "old"}
    _age(left[0], stale)
    assert recipe.settle_staging(tmp_path, job="newer") == [] and not left[0].exists(), "abandoned once stale"


def test_a_save_committed_by_the_next_launch_is_committed_once(tmp_path):
    """The job that saved and a later launch may both commit one save (its rank 0 had not yet renamed it): the
    rename happens once and both get the committed checkpoint."""
    _stage(tmp_path, 3, "a")
    assert recipe.settle_staging(tmp_path, job="b") == []
    assert recipe.commit(tmp_path, 3, job="a") == tmp_path / "step_00000003"
    assert torch.equal(load(recipe.latest(tmp_path)), torch.full((4,), 3.0))


def test_a_job_is_torchruns_run_id_made_safe_as_a_name(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run/1 x")
    assert recipe.job_id() == "run_1_x" and recipe.staging_dir("d", 5).name == ".step_00000005.run_1_x.partial"
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert recipe.job_id() == "4242"


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
    recipe.settle_staging(tmp_path)  # what the next run of this job does before it saves
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000010"]


def test_the_cluster_script_commits_with_the_same_protocol():
    sys.path.insert(0, str(SCRIPTS))
    import cluster_ddp

    for name in ("staging_dir", "commit", "agreed_latest", "settle_staging"):
        assert getattr(cluster_ddp, name) is getattr(recipe, name), f"cluster_ddp.py has its own {name}"


def test_an_async_save_is_committed_by_poll_once_written_and_not_before(tmp_path, monkeypatch):
    """`Checkpointer.poll()`, called every step by train.py: a crash between two saves loses only the steps since
    the last one written, not a save that finished in the background but waited for the next save to commit."""
    from concurrent.futures import Future

    monkeypatch.setattr(recipe.dist, "get_rank", lambda: 0)  # rank 0 commits; no process group needed for that
    checkpointer = object.__new__(recipe.Checkpointer)       # its __init__ makes a gloo group: not needed here
    checkpointer.root, checkpointer.keep, checkpointer.config, checkpointer.job = tmp_path, 2, {}, recipe.job_id()
    save_step(tmp_path, 4, 4.0)
    written = Future()
    checkpointer.pending = (written, 4)
    checkpointer.poll()
    assert recipe.latest(tmp_path) is None and checkpointer.pending is not None, "still being written: not committed"
    written.set_result(None)
    checkpointer.poll()
    assert recipe.latest(tmp_path) == tmp_path / "step_00000004" and checkpointer.pending is None
    assert torch.equal(load(recipe.latest(tmp_path)), torch.full((4,), 4.0))


def test_the_generators_come_back_at_the_world_size_that_saved_them_only(tmp_path, monkeypatch):
    monkeypatch.setattr(recipe.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(recipe.dist, "get_world_size", lambda: 2)
    torch.manual_seed(5)
    recipe.save_rng(tmp_path)
    drawn = torch.rand(3)
    assert recipe.load_rng(tmp_path) and torch.equal(torch.rand(3), drawn), "rank 1's state, restored"
    assert (tmp_path / recipe.RNG_DIR / "rank00001.pt").exists()
    monkeypatch.setattr(recipe.dist, "get_world_size", lambda: 3)
    before = torch.get_rng_state()
    assert not recipe.load_rng(tmp_path) and torch.equal(torch.get_rng_state(), before), "another world: ignored"


def _views_of_one_directory(base, newest_for_rank1):
    """Every rank's Checkpointer on its own view of the checkpoint directory (disks not shared, or a network file
    system's stale cache): rank 0 sees steps 2 and 4, rank 1 `newest_for_rank1`. Returns what each rank loaded,
    or the error it raised."""
    from pathlib import Path

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import checkpoint

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = Path(base) / f"view{rank}"
    if rank == 0:
        for view, steps in (("view0", (2, 4)), ("view1", newest_for_rank1)):
            for step in steps:
                dcp.save({"train": {"w": torch.full((4,), float(step))}}, no_dist=True,
                         checkpoint_id=checkpoint.staging_dir(Path(base) / view, step))
                checkpoint.commit(Path(base) / view, step)
    dist.barrier()
    try:
        state = {"w": torch.zeros(4)}
        path = checkpoint.Checkpointer(root).load_latest(state)
        return {"path": path.name, "w": state["w"][0].item()}
    except checkpoint.CheckpointError as error:
        return {"error": str(error)}
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_every_rank_loads_rank_0s_pick_or_all_refuse_in_one_line(tmp_path):
    from helpers.launcher import launch

    env = {"CUDA_VISIBLE_DEVICES": ""}
    newer = launch(_views_of_one_directory, str(tmp_path / "a"), (2, 4, 6), world_size=2, timeout=60, env=env)
    assert newer == [{"path": "step_00000004", "w": 4.0}] * 2, "rank 1 sees a newer step 6: it loads rank 0's 4"
    older = launch(_views_of_one_directory, str(tmp_path / "b"), (2,), world_size=2, timeout=60, env=env)
    assert all("step_00000004, which rank 1 cannot see" in r["error"] for r in older), older
    assert all(len(r["error"].splitlines()) == 1 for r in older), "every rank refuses, in one line"


def _resume_a_save_with_groups_by_position(base):
    """One gloo rank: a committed checkpoint whose optimizer groups are a list (the recipe's saves before TrainState
    flattened them), then load_latest."""
    from pathlib import Path

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import checkpoint

    dist.init_process_group("gloo")
    try:
        groups = [{"params": [0], "lr": 1e-3, "betas": (0.9, 0.95)}]
        dcp.save({"train": {"optim": {"state": {0: {"exp_avg": torch.zeros(4)}}, "param_groups": groups}}},
                 checkpoint_id=checkpoint.staging_dir(Path(base), 2), no_dist=True)
        checkpoint.commit(Path(base), 2)
        try:
            checkpoint.Checkpointer(Path(base)).load_latest({"w": torch.zeros(4)})
        except checkpoint.CheckpointError as error:
            return str(error)
        return None
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_save_with_the_optimizers_groups_by_position_is_refused_in_one_line(tmp_path):
    """Such a save holds one pipeline stage's groups only; loaded, AdamW failed later with KeyError 'betas'."""
    from helpers.launcher import launch

    error = launch(_resume_a_save_with_groups_by_position, str(tmp_path), world_size=1, timeout=60,
                   env={"CUDA_VISIBLE_DEVICES": ""})[0]
    assert error is not None and "keeps the optimizer's groups by position" in error and len(error.splitlines()) == 1
