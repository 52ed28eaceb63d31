"""Unit tests of helpers.measure.disk: the summary of a checkpoint's costs (what notebook 06's save_costs worker
returns; the notebook runs that worker, in smoke mode too), a folder's layout."""
from __future__ import annotations

import torch

from helpers.measure import disk


def test_directory_bytes(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 100)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(b"y" * 23)
    assert disk.directory_bytes(tmp_path) == 123


OPS = ("disk write + fsync", "dcp.save", "dcp.save, 4 writer threads", "async_save, default stager (blocking)",
       "async_save, default stager (until written)", "dcp.load")


def test_summarize_costs_takes_the_slowest_rank_and_ratios_side_by_side():
    fast = dict(zip(OPS, ([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [1.0] * 3, [0.5, 0.5, 0.5], [2.0, 2.0, 2.0], [1.0] * 3)))
    slow = dict(zip(OPS, ([1.0, 2.0, 1.0], [4.0, 2.0, 2.0], [1.0] * 3, [0.5, 1.0, 0.2], [2.0, 2.0, 2.0], [1.0] * 3)))
    s = disk.summarize_costs([{"times": fast, "held_bytes": 100, "on_disk": 210, "device": "cpu"},
                              {"times": slow, "held_bytes": 100, "on_disk": None, "device": "cpu"}])
    assert s["state_bytes"] == 200 and s["on_disk"] == 210 and s["device"] == "cpu" and s["world_size"] == 2
    assert s["seconds"]["dcp.save"] == [4.0, 2.0, 2.0]
    assert sorted(s["save_vs_disk"]) == ["dcp.save", "dcp.save, 4 writer threads"], "every synchronous save"
    assert s["save_vs_disk"]["dcp.save"]["values"] == [0.25, 1.0, 0.5]  # disk seconds / save seconds, per repeat
    assert s["save_vs_disk"]["dcp.save, 4 writer threads"]["values"] == [1.0, 2.0, 1.0]
    assert list(s["blocking_share"]) == ["async_save, default stager (blocking)"]
    assert s["blocking_share"]["async_save, default stager (blocking)"]["values"] == [0.125, 0.5, 0.25]
    ratio = s["save_vs_disk"]["dcp.save"]
    assert (ratio["median"], ratio["min"], ratio["max"]) == (0.5, 0.25, 1.0) and s["rate"]["dcp.save"] == 200 / 2.0
    text = disk.ratios_text(s)
    assert "dcp.save: rate / disk rate" in text and "0.500 (0.250-1.000)" in text


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


def test_record_headlines_names_every_ratio(capsys):
    disk.record_headlines({"save_vs_disk": {"dcp.save": {"median": 0.8}, "dcp.save, 4 writer threads": {"median": 0.9}},
                           "blocking_share": {"async_save, default stager (blocking)": {"median": 0.25},
                                              "async_save, pinned reused stager (blocking)": {"median": 0.05}}})
    out = capsys.readouterr().out  # outside a kernel, headline prints
    assert "dcp.save throughput / disk write+fsync rate: 0.8 x" in out
    assert "dcp.save, 4 writer threads throughput / disk write+fsync rate: 0.9 x" in out
    assert "async_save blocking / sync save time: 0.25 x" in out, "the default keeps its name from run to run"
    assert "async_save, pinned reused stager blocking / sync save time: 0.05 x" in out


def test_whole_checkpoint_reads_a_dcp_folder_in_one_process(tmp_path):
    import torch.distributed.checkpoint as dcp
    state = {"app": {"w": torch.arange(6.0).view(2, 3), "step": 3}}
    dcp.save(state, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    whole = disk.whole_checkpoint(tmp_path / "ckpt", tmp_path / "whole.pt")
    assert (tmp_path / "whole.pt").exists() and whole["app"]["step"] == 3
    torch.testing.assert_close(whole["app"]["w"], state["app"]["w"], rtol=0, atol=0)
