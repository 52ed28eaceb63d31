"""Unit tests of helpers.measure.disk: the disk's rate, byte counting, and the summary of a checkpoint's costs."""
from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, init_device_mesh

from helpers.measure import disk


def test_disk_write_rate_is_positive_and_leaves_nothing_behind(tmp_path):
    writes = disk.disk_write_rate(tmp_path, 1 << 20, repeats=2)
    assert len(writes) == 2 and all(r > 0 for r in writes)
    assert list(tmp_path.iterdir()) == []


def test_directory_bytes(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 100)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(b"y" * 23)
    assert disk.directory_bytes(tmp_path) == 123


def test_state_bytes_counts_tensors_in_nested_state_and_stateful_objects():
    state = {"model": {"w": torch.zeros(10), "b": torch.zeros(3, dtype=torch.float16)},
             "optim": [torch.zeros(2, dtype=torch.float64)], "step": 7, "name": "x"}
    assert disk.state_bytes(state) == 40 + 6 + 16
    assert disk.state_bytes({"app": torch.nn.Linear(3, 2)}) == (6 + 2) * 4  # a Stateful counts its state_dict()


def test_state_bytes_counts_the_local_shard_of_a_dtensor():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        d = DTensor.from_local(torch.zeros(5), mesh, [Shard(0)])
        counted = disk.state_bytes({"p": d})
        del d, mesh  # what holds the gloo group goes before the group (a late free can hang in gloo's teardown)
        gc.collect()
    finally:
        dist.destroy_process_group()
    assert counted == 20


def test_summarize_costs_takes_the_slowest_rank_and_ratios_side_by_side():
    fast = dict(zip(disk.OPS, ([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [0.5, 0.5, 0.5], [2.0, 2.0, 2.0], [1.0] * 3)))
    slow = dict(zip(disk.OPS, ([1.0, 2.0, 1.0], [4.0, 2.0, 2.0], [0.5, 1.0, 0.2], [2.0, 2.0, 2.0], [1.0] * 3)))
    s = disk.summarize_costs([{"times": fast, "held_bytes": 100, "on_disk": 210, "device": "cpu"},
                              {"times": slow, "held_bytes": 100, "on_disk": None, "device": "cpu"}])
    assert s["state_bytes"] == 200 and s["on_disk"] == 210 and s["device"] == "cpu" and s["world_size"] == 2
    assert s["seconds"]["dcp.save"] == [4.0, 2.0, 2.0]
    assert s["ratios"]["save_vs_disk"]["values"] == [0.25, 1.0, 0.5]  # disk seconds / save seconds, per repeat
    assert s["ratios"]["blocking_share"]["values"] == [0.125, 0.5, 0.25]
    assert s["ratios"]["save_vs_disk"]["median"] == 0.5 and s["rate"]["dcp.save"] == 200 / 2.0
    low, high = s["ratios"]["save_vs_disk"]["interval"]
    assert 0.25 <= low <= 0.5 <= high <= 1.0


@pytest.mark.timeout(120)
def test_checkpoint_costs_runs_where_the_notebook_runs_it(tmp_path):
    # 2 CPU ranks here; on a GPU machine a rank per GPU (1 on one GPU), with CUDA state and "cpu:gloo,cuda:nccl"
    import functools

    from helpers.devices import gpu_count
    from helpers.launcher import launch

    n = disk.bench_ranks(2, gpu_count())
    results = launch(disk.checkpoint_costs, functools.partial(_linear_state, 64), str(tmp_path), 2, world_size=n)
    assert [r["device"].split(":")[0] for r in results] == ["cuda" if gpu_count() else "cpu"] * n
    assert [sorted(r["times"]) for r in results] == [sorted(disk.OPS)] * n
    assert all(len(v) == 2 and min(v) > 0 for r in results for v in r["times"].values())
    assert results[0]["held_bytes"] == 64 * 64 * 4 and results[0]["on_disk"] >= n * 64 * 64 * 4
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"disk{r}" for r in range(n)]  # checkpoints removed
    assert all(list(p.iterdir()) == [] for p in tmp_path.iterdir())


def _linear_state(width, device):
    # each rank holds its own weight under one key per rank: the files hold both
    rank = dist.get_rank()
    return {f"w{rank}": torch.full((width, width), float(rank), device=device)}


def test_checkpoint_layout_lists_chunks_files_and_counts_every_tensor_once(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(12.0).view(4, 3), "b": torch.zeros(5, dtype=torch.float64), "step": 3}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    meta = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    layout = disk.checkpoint_layout(tmp_path, meta, "w")
    assert layout["shape"] == (4, 3) and layout["keys"] == ["b", "step", "w"]
    assert [c["offsets"] for c in layout["chunks"]] == [(0, 0)] and layout["chunks"][0]["file"].endswith(".distcp")
    assert layout["tensor_bytes"] == 12 * 4 + 5 * 8
    assert layout["file_bytes"] == sum(p.stat().st_size for p in tmp_path.glob("*.distcp")) >= layout["tensor_bytes"]
    assert "(0, 0)  (4, 3)" in disk.layout_text(layout)


def test_costs_table_warns_only_when_ranks_outnumber_cores():
    summary = {"state_bytes": 2 << 20, "on_disk": 2 << 20, "median_s": {"dcp.save": 0.5}, "rate": {"dcp.save": 4 << 20},
               "seconds": {"dcp.save": [0.4, 0.5, 0.75]}, "device": "cpu", "world_size": 2}
    table = disk.costs_table(summary, 3, 2)
    assert "2 MiB of tensors over 2 rank(s)" in table and "500.0 ms" in table and "WARNING" not in table
    assert "500.0 ms (400.0-750.0)" in table, "the spread of the repeats beside the median"
    assert "WARNING: 3 ranks on 2 cores" in disk.costs_table({**summary, "world_size": 3}, 3, 2)


def test_bench_ranks_measure_cuda_state_wherever_there_is_a_gpu():
    assert disk.bench_ranks(2, 1) == 1  # one GPU: the notebook's 2 CPU ranks would measure no CUDA staging
    assert disk.bench_ranks(8, 8) == 8 and disk.bench_ranks(4, 8) == 4  # a rank per GPU, as many as asked
    assert disk.bench_ranks(2, 0) == 2  # no GPU: the notebook's CPU ranks


def test_record_headlines_names_both_ratios(capsys):
    disk.record_headlines({"ratios": {"save_vs_disk": {"median": 0.8}, "blocking_share": {"median": 0.25}}})
    out = capsys.readouterr().out  # outside a kernel, headline prints
    assert "dcp.save throughput / disk write+fsync rate: 0.8 x" in out
    assert "async_save blocking / sync save time: 0.25 x" in out


def test_whole_checkpoint_reads_a_dcp_folder_in_one_process(tmp_path):
    import torch.distributed.checkpoint as dcp
    state = {"app": {"w": torch.arange(6.0).view(2, 3), "step": 3}}
    dcp.save(state, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    whole = disk.whole_checkpoint(tmp_path / "ckpt", tmp_path / "whole.pt")
    assert (tmp_path / "whole.pt").exists() and whole["app"]["step"] == 3
    torch.testing.assert_close(whole["app"]["w"], state["app"]["w"], rtol=0, atol=0)


def _save_a_then_die(root, tag):
    torch.save({"tag": tag, "name": "A"}, f"{root}/state_A.pt")
    torch.save({"tag": tag, "name": "B"}, f"{root}/state_B.pt")
    raise RuntimeError("died saving B")


def _load(folder):
    if folder.endswith("torn"):
        raise RuntimeError("cannot load a torn checkpoint")
    return {"step": 2, "folder": folder}


def test_crash_then_load_keeps_both_states_and_what_loaded(tmp_path, monkeypatch, capsys):
    from helpers import launcher
    from helpers.launcher.errors import RankFailure, WorkerError

    calls = []

    def fake_launch(fn, *args, world_size, timeout, env=None, quiet=False):
        calls.append((fn.__name__, args, world_size, env, quiet))
        try:
            return [fn(*args)]
        except RuntimeError as error:
            failure = RankFailure(rank=world_size - 1, kind="exception", message=str(error))
            raise WorkerError(failure, [failure]) from None

    monkeypatch.setattr(launcher, "launch", fake_launch)
    good = disk.crash_then_load(_save_a_then_die, _load, tmp_path / "ok", lambda root: root / "newest", "x",
                                world_size=2, timeout=5, env={"E": "1"})
    assert "ok: the save of B crashed (died saving B, rank 1)" in capsys.readouterr().out
    assert good["step"] == 2 and good["folder"] == str(tmp_path / "ok" / "newest")
    assert good["A"] == {"tag": "x", "name": "A"} and good["B"]["name"] == "B"
    assert calls[0] == ("_save_a_then_die", (str(tmp_path / "ok"), "x"), 2, {"E": "1"}, True)
    assert calls[1][2:] == (1, None, True), "the load: one process, the kernel's environment"
    bad = disk.crash_then_load(_save_a_then_die, _load, tmp_path / "bad", lambda root: root / "torn", "y",
                               world_size=2, timeout=5)
    assert bad["error"] == "cannot load a torn checkpoint" and bad["A"]["tag"] == "y"
