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


def _checkpoint_of(folder, root, dtype: str, trained_on: dict | None = None):
    """A committed checkpoint of the recipe holding `folder`'s weights, as `train.py --init-from FOLDER --dtype DTYPE`
    saves it (written here by one process) on the data `trained_on` describes, and the recipe's model holding them."""
    import dataclasses

    import torch.distributed.checkpoint as dcp

    cfg = recipe.hf_model_config(folder)
    model = Llama(cfg)
    recipe.load_hf(model, folder)
    dcp.save({"train": {"model": model.state_dict()}}, checkpoint_id=recipe.staging_dir(root, 1, "t"), no_dist=True)
    config = {"model": dataclasses.asdict(cfg), "args": {"dtype": dtype, "init_from": str(folder)},
              "data": trained_on or {}}
    return recipe.commit(root, 1, config=config, job="t"), model.eval()


def test_an_export_is_written_file_by_file_holding_one_files_tensors_at_a_time(downloads, tmp_path, monkeypatch):
    """export_hf past --max-shard-size: safetensors files of at most that many bytes (a larger tensor alone) with
    their index, as save_pretrained writes them, that transformers opens as the same model; written from the DCP
    checkpoint one file at a time: the tensors it allocates, reads and writes (each tracked until freed) never weigh
    more than a file and the one tensor it reorders (wq, wk) beside it, never the whole model (nor two files)."""
    import json
    import weakref

    import safetensors.torch
    import torch.distributed.checkpoint as dcp
    from transformers import LlamaForCausalLM

    checkpoint, model = _checkpoint_of(downloads.llama2, tmp_path / "ckpt", "fp32")
    alive, peak = {}, [0]

    def track(tensors):
        """Count these tensors until they are freed; note the most counted at once."""
        for t in tensors:
            if id(t) not in alive:
                alive[id(t)] = t.numel() * t.element_size()
                weakref.finalize(t, alive.pop, id(t))
        peak[0] = max(peak[0], sum(alive.values()))

    def leaves(state):
        return [leaf for v in state.values() for leaf in (leaves(v) if isinstance(v, dict) else [v])]

    real_load, real_save = dcp.load, safetensors.torch.save_file

    def load(state, **kwargs):                  # what the export asks DCP to fill
        track(leaves(state))
        return real_load(state, **kwargs)

    def save_file(tensors, *args, **kwargs):    # what it writes
        track(tensors.values())
        return real_save(tensors, *args, **kwargs)

    class Torch:
        """torch as checkpoint.py sees it, its torch.empty tracked: what the export allocates, while the previous
        file's tensors may still be alive. (torch itself stays as it is: its meta-device context keeps the factory
        functions it found first, and a patched torch.empty there would outlive this test.)"""

        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*args, **kwargs):
            tensor = torch.empty(*args, **kwargs)
            track([tensor])
            return tensor

    for module, name, wrapper in ((dcp, "load", load), (safetensors.torch, "save_file", save_file),
                                  (recipe, "torch", Torch())):
        monkeypatch.setattr(module, name, wrapper)
    limit = 100_000
    out = recipe.export_hf(checkpoint, tmp_path / "hf", max_shard_bytes=limit)

    index = json.loads((out / recipe.HF_INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    whole = sum(p.numel() * 4 for p in model.parameters())
    assert len(files) >= 3 and files == sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
    assert index["metadata"]["total_size"] == whole and not (out / recipe.HF_WEIGHTS).exists()
    sizes = {file: [t.numel() * 4 for t in safetensors.torch.load_file(out / file).values()] for file in files}
    assert all(sum(s) <= limit or len(s) == 1 for s in sizes.values()), sizes
    bound = max(map(sum, sizes.values())) + model.layers["0"].attention.wq.weight.numel() * 4
    assert 0 < peak[0] <= bound < whole / 2, f"held {peak[0]} bytes at once: more than a file and a wq ({bound})"
    theirs = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, model(tokens), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name, dtype", [("llama2", "fp32"), ("llama3", "bf16")])
def test_an_export_opens_in_transformers_as_the_download_it_started_from(downloads, tmp_path, name, dtype):
    """A run started from a download (--init-from FOLDER, its data prepared with the folder's tokenizer), exported:
    AutoTokenizer opens the tokenizer it trained with (the same ids for the same text, BOS included, decoding back
    to the text, the same special tokens and chat template), generation_config.json stops at the same EOS ids (a
    list for Llama 3.2), config.json names the dtype the run trained in and the weights are in it, and
    LlamaForCausalLM gives the recipe's logits."""
    import json

    import safetensors.torch
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig, LlamaForCausalLM

    import data
    import user_folders

    folder, torch_dtype = getattr(downloads, name), {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    docs = user_folders.corpus()[:40]
    tokens = data.prepare(docs, tmp_path / "tokens.bin", tokenizer=folder)
    checkpoint, model = _checkpoint_of(folder, tmp_path / "ckpt", dtype, data.describe([tokens]))
    out = recipe.export_hf(checkpoint, tmp_path / "hf")

    assert {"config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
            "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    theirs, ours = AutoTokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(out)
    for text in (docs[3][:400], "Hello world, the with statement.", "ünïcödé and\ttabs\n\nand lines"):
        assert ours(text).input_ids == theirs(text).input_ids, text
        assert ours.decode(ours(text, add_special_tokens=False).input_ids) == text
    assert (ours.bos_token, ours.eos_token, ours.chat_template) == \
        (theirs.bos_token, theirs.eos_token, theirs.chat_template)
    if theirs.chat_template:
        chat = [{"role": "user", "content": "Explain: the with statement"}]
        assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(chat, tokenize=False)
    assert GenerationConfig.from_pretrained(out).eos_token_id == GenerationConfig.from_pretrained(folder).eos_token_id
    assert AutoConfig.from_pretrained(out).dtype == torch_dtype
    assert {t.dtype for t in safetensors.torch.load_file(out / recipe.HF_WEIGHTS).values()} == {torch_dtype}
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == data.read_meta(tokens)["eot_id"]
    theirs_model = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([ours(docs[5][:300]).input_ids])
    with torch.no_grad():
        torch.testing.assert_close(theirs_model(ids).logits, model(ids), rtol=0, atol=1e-5)


def test_the_init_from_folder_fills_in_only_what_the_token_files_own_tokenizer_lacks(downloads, tmp_path):
    """An older token file kept its tokenizer.json alone (`tokens.bin.tokenizer.json`): a run started from the
    Llama 3.2 folder whose data that tokenizer made exports the folder's chat template and its list of EOS ids. A
    token file of another tokenizer (GPT-2's) takes nothing from the folder: its files describe another vocabulary."""
    import shutil

    from transformers import AutoTokenizer, GenerationConfig

    assert len(GenerationConfig.from_pretrained(downloads.llama3).eos_token_id) == 3
    for name, source in (("same", downloads.llama3), ("other", downloads.gpt2)):
        alone = tmp_path / f"{name}.bin.tokenizer.json"
        shutil.copy(source / "tokenizer.json", alone)
        checkpoint, _ = _checkpoint_of(downloads.llama3, tmp_path / f"ck_{name}", "bf16", {"tokenizer": str(alone)})
        out = recipe.export_hf(checkpoint, tmp_path / f"hf_{name}")
        ours, theirs = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(source)
        assert (ours.eos_token, ours.chat_template) == (theirs.eos_token, theirs.chat_template), name
        listed = GenerationConfig.from_pretrained(source).eos_token_id if name == "same" else theirs.eos_token_id
        assert GenerationConfig.from_pretrained(out).eos_token_id == listed, name
