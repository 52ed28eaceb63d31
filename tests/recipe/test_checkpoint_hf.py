"""Hugging Face folders both ways (scripts/train/checkpoint.py, made of notebook 06's cells), with folders shaped as
users download them (tests/recipe/user_folders.py: a Llama 2 in fp16, untied; a Llama 3.2 in bf16, tied, with GQA).

Loading that scales: `load_hf` into FSDP2, tensor parallel, FSDP2 x TP, HSDP and an uneven FSDP2 over 3 ranks reads
on each rank only the slices its pieces hold (counted at the safetensors reader: what every slice handed out
weighs), in the folder's dtype, and loads the very parameters one process's `load_hf` does. It used to read every
whole tensor on every rank and convert it to float32 there.
"""
from __future__ import annotations

import sys

import pytest
import torch

from helpers.paths import SCRIPTS

sys.path.insert(0, str(SCRIPTS / "train"))
import checkpoint as recipe  # noqa: E402
from model import Llama  # noqa: E402

# layouts (dp_replicate, dp_shard, tp) per world size: FSDP2, TP, FSDP2 x TP (whose FSDP2 dimension is a
# _StridedShard), HSDP, and 3 ranks, where FSDP2's pieces are uneven and cut through heads
LAYOUTS = {2: [(1, 2, 1), (1, 1, 2)], 3: [(1, 3, 1)], 4: [(1, 2, 2), (2, 2, 1)]}


def _load_at_layouts(folders, layouts):
    """Each folder loaded by the recipe's load_hf at each layout of these ranks: the bytes this rank read from the
    folder (every tensor the safetensors reader handed out), the dtypes they came in, the bytes its pieces of the
    model hold in the folder's dtype, the rows `read_piece` may add for wq and wk (a head's rows at each end), and the
    parameters, gathered whole."""
    import safetensors
    import torch
    import torch.distributed as dist

    import checkpoint
    from model import Llama, has_rotary_rows, local_piece
    from parallelize import apply_fsdp, build_mesh
    from tp import apply_tp

    read = {"bytes": 0, "dtypes": set()}
    real_open = safetensors.safe_open

    def counted(tensor):
        read["bytes"] += tensor.numel() * tensor.element_size()
        read["dtypes"].add(tensor.dtype)
        return tensor

    class Slice:
        def __init__(self, inner):
            self.inner = inner

        def get_shape(self):
            return self.inner.get_shape()

        def __getitem__(self, box):
            return counted(self.inner[box])

    class Opened:
        def __init__(self, *args, **kwargs):
            self.inner = real_open(*args, **kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def keys(self):
            return self.inner.keys()

        def get_slice(self, key):
            return Slice(self.inner.get_slice(key))

        def get_tensor(self, key):
            return counted(self.inner.get_tensor(key))

    safetensors.safe_open = Opened
    dist.init_process_group("gloo")
    out = {}
    try:
        for folder in folders:
            cfg = checkpoint.hf_model_config(folder)
            for replicate, shard, tp in layouts:
                with torch.device("meta"):
                    model = Llama(cfg)
                mesh = build_mesh(dist.get_world_size(), replicate, shard, tp, 1, "cpu", cfg)
                if tp > 1:
                    apply_tp(model, mesh["tp"], loss_parallel=True)
                if replicate * shard > 1:
                    apply_fsdp(model, mesh[("dp_replicate", "dp_shard")] if replicate > 1 else mesh["dp_shard"])
                model.to_empty(device="cpu")
                read.update(bytes=0, dtypes=set())
                checkpoint.load_hf(model, folder)
                itemsize = next(iter(read["dtypes"])).itemsize
                pieces = {name: local_piece(p) for name, p in model.named_parameters()}
                out[(folder, replicate, shard, tp)] = {
                    **read, "held": sum(local.numel() for _, _, local in pieces.values()) * itemsize,
                    "head_ends": sum(2 * cfg.head_dim * sizes[1] * itemsize for name, (_, sizes, local) in
                                     pieces.items() if has_rotary_rows(name) and local.numel()),
                    "params": {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
                               for k, v in model.state_dict().items()}}
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_each_rank_reads_only_its_pieces_in_the_folders_dtype_and_loads_one_processs_weights(downloads, world):
    from helpers.launcher import launch

    folders = [str(downloads.llama2), str(downloads.llama3)]
    ranks = launch(_load_at_layouts, folders, LAYOUTS[world], world_size=world, timeout=500,
                   env={"CUDA_VISIBLE_DEVICES": ""})
    for folder, dtype in zip(folders, (torch.float16, torch.bfloat16)):
        whole = Llama(recipe.hf_model_config(folder))
        recipe.load_hf(whole, folder)
        model_bytes = sum(p.numel() for p in whole.parameters()) * dtype.itemsize
        for replicate, shard, tp in LAYOUTS[world]:
            for rank, result in enumerate(ranks):
                got = result[(folder, replicate, shard, tp)]
                where = f"{folder}, dp_replicate {replicate} x dp_shard {shard} x tp {tp}, rank {rank}"
                assert got["dtypes"] == {dtype}, f"{where}: read as {got['dtypes']}, not the folder's {dtype}"
                assert got["held"] <= got["bytes"] <= got["held"] + got["head_ends"], \
                    f"{where}: read {got['bytes']} bytes, its pieces hold {got['held']}"
                assert got["bytes"] < 0.75 * model_bytes, f"{where}: read {got['bytes']} of {model_bytes} bytes"
                torch.testing.assert_close(got["params"], whole.state_dict(), rtol=0, atol=0, msg=where)
