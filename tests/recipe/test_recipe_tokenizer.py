"""scripts/train/data.py reads the tokenizers users download (tests/recipe/user_folders.py, folders written by
transformers' own save_pretrained): `read_tokenizer` held against transformers (BOS, EOS, the EOS ids generation
stops at, the chat template; the Hub's layout and transformers 5's); `prepare`'s ids against AutoTokenizer's, each
document's plus the EOS, from a folder, from its tokenizer.json and from a tokenizer.json alone; the folder
`prepare` writes beside the tokens opens in AutoTokenizer as the tokenizer the tokens were made with; an older
token file's tokenizer.json still reads; and `train.py prepare`, run from a copy of the recipe, takes a folder,
refuses a tokenizer with no end-of-text token in one line (exit status 2), takes `--eos-token` naming one, and
writes the same shards on two worker processes as on one (`--workers`, `--shard-tokens`)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import user_folders
from helpers.paths import SCRIPTS
from user_folders import GPT2_SHAPE, LLAMA2_SHAPE, LLAMA3_SHAPE

sys.path.insert(0, str(SCRIPTS / "train"))
import data  # noqa: E402

pytest.importorskip("transformers")
SHAPES = {"gpt2": GPT2_SHAPE, "llama2": LLAMA2_SHAPE, "llama3": LLAMA3_SHAPE}
DOCS = user_folders.corpus()[:6] + ["wörld ☃ and a last line\n"]
PREPARE_TIMEOUT_S = 300          # a prepare of a few kilobytes takes seconds (importing torch, through train.py)


def _tokenizer_path(downloads, name, form, tmp_path):
    """The tokenizer as a user hands it: the folder, its tokenizer.json (beside its other files), or that file alone."""
    folder = getattr(downloads, name)
    if form == "folder":
        return folder
    if form == "file":
        return folder / "tokenizer.json"
    alone = tmp_path / f"{name}_alone"
    alone.mkdir()
    return shutil.copy(folder / "tokenizer.json", alone / "tokenizer.json")


def _reference_ids(reference, docs):
    return [i for doc in docs for i in reference(doc).input_ids + [reference.eos_token_id]]


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("form", ["folder", "file"])
def test_read_tokenizer_names_the_special_tokens_transformers_names(downloads, tmp_path, name, form):
    from transformers import AutoTokenizer, GenerationConfig

    folder = getattr(downloads, name)
    ours, theirs = data.read_tokenizer(_tokenizer_path(downloads, name, form, tmp_path)), \
        AutoTokenizer.from_pretrained(folder)
    assert (ours.bos_id, ours.eos_id) == (theirs.bos_token_id, theirs.eos_token_id)
    assert ours.adds_bos == SHAPES[name].adds_bos == (theirs("a").input_ids[0] == theirs.bos_token_id)
    assert ours.chat_template == theirs.chat_template, "the template inside tokenizer_config.json (the Hub's layout)"
    if (folder / "generation_config.json").exists():
        listed = GenerationConfig.from_pretrained(folder).eos_token_id
        assert ours.eos_ids == (listed if isinstance(listed, list) else [listed])
    else:
        assert ours.eos_ids == [theirs.eos_token_id]
    assert "tokenizer.json" in ours.files and "config.json" not in ours.files and "model.safetensors" not in ours.files
    assert ours.eos_from == "tokenizer_config.json", "named by its own files, not guessed from a spelling"


def test_read_tokenizer_takes_transformers_5s_layout(tmp_path):
    """transformers 5 writes the chat template to chat_template.jinja and no special_tokens_map.json."""
    from transformers import AutoTokenizer

    user_folders.llama3_tokenizer(tmp_path)
    assert (tmp_path / "chat_template.jinja").exists() and not (tmp_path / "special_tokens_map.json").exists()
    ours, theirs = data.read_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    assert ours.chat_template == theirs.chat_template == user_folders.LLAMA3_CHAT_TEMPLATE
    assert (ours.bos_id, ours.eos_id, ours.adds_bos) == (theirs.bos_token_id, theirs.eos_token_id, True)
    assert "chat_template.jinja" in ours.files


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("form", ["folder", "file", "alone"])
def test_prepare_writes_transformers_ids_and_the_eos_for_each_document(downloads, tmp_path, name, form):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(getattr(downloads, name))
    out = data.prepare(DOCS, tmp_path / "t.bin", 0.2, _tokenizer_path(downloads, name, form, tmp_path))
    meta = data.read_meta(out)
    tokens = np.fromfile(out, dtype=meta["dtype"]).tolist()
    assert tokens == _reference_ids(reference, DOCS)
    assert tokens.count(reference.eos_token_id) == len(DOCS)
    if SHAPES[name].adds_bos:
        starts = [0] + [i + 1 for i, t in enumerate(tokens[:-1]) if t == reference.eos_token_id]
        assert tokens.count(reference.bos_token_id) == len(DOCS) and all(tokens[i] == meta["bos_id"] for i in starts), \
            "each document opens with exactly one BOS"
    folder = tmp_path / meta["tokenizer"]
    assert data.describe([out])["tokenizer"] == str(folder.resolve())
    reopened = AutoTokenizer.from_pretrained(folder)      # the tokenizer the tokens were made with, for transformers
    bos = None if (name, form) == ("gpt2", "alone") else reference.bos_token   # GPT-2's file alone names no BOS
    assert (reopened.bos_token, reopened.eos_token) == (bos, reference.eos_token)
    assert _reference_ids(reopened, DOCS) == tokens
    again, source = data.read_tokenizer(folder), data.read_tokenizer(getattr(downloads, name))
    assert (again.bos_id, again.eos_id, again.adds_bos, again.chat_template) == \
        (meta["bos_id"], meta["eot_id"], source.adds_bos, source.chat_template if form != "alone" else None)
    assert again.eos_ids == (source.eos_ids if form != "alone" else [source.eos_id])


def test_a_tokenizer_trained_here_is_saved_as_a_folder_transformers_opens(tmp_path):
    from transformers import AutoTokenizer

    docs = ["first document, with words", "the second one", "a third"]
    out = data.prepare(docs, tmp_path / "t.bin", 0.2, data.train_tokenizer(docs * 20, vocab_size=300))
    meta = data.read_meta(out)
    reopened = AutoTokenizer.from_pretrained(tmp_path / meta["tokenizer"])
    assert reopened.eos_token == data.EOT and reopened.eos_token_id == meta["eot_id"]
    assert _reference_ids(reopened, docs) == np.fromfile(out, dtype=np.uint16).tolist()


def test_an_older_token_files_tokenizer_json_still_reads(tmp_path):
    """Token files written before the folder: the meta names `OUT.tokenizer.json`, a tokenizer file alone."""
    import generate

    docs = ["first document, with words", "the second one"]
    trained = data.train_tokenizer(docs * 20, vocab_size=300)
    out = data.prepare(docs, tmp_path / "t.bin", 0.5, trained)
    meta = data.read_meta(out)
    shutil.rmtree(tmp_path / meta["tokenizer"])
    trained.save(str(tmp_path / "t.bin.tokenizer.json"))
    data.meta_path(out).write_text(json.dumps({**meta, "tokenizer": "t.bin.tokenizer.json"}))
    described = data.describe([out])["tokenizer"]
    assert described == str((tmp_path / "t.bin.tokenizer.json").resolve())
    assert data.read_tokenizer(described).eos_id == meta["eot_id"]
    assert generate.Codec(described).decode(np.fromfile(out, dtype=np.uint16).tolist()[:-1]).startswith(docs[0])


# ---------------------------------------------------------------------------- train.py prepare, as a user runs it
@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """scripts/train/ copied into an empty folder (helpers not importable), a text file and a tokenizer.json that
    has no end-of-text token of any known spelling (its one special token is <|doc|>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("prepare")
    for source in (SCRIPTS / "train").glob("*.py"):
        shutil.copy(source, root / source.name)
    (root / "text.txt").write_text("\n@@\n".join(DOCS), encoding="utf-8")
    plain = Tokenizer(models.BPE())
    plain.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    plain.train_from_iterator(DOCS * 5, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|doc|>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                            show_progress=False))
    (root / "no_eos").mkdir()
    plain.save(str(root / "no_eos" / "tokenizer.json"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COOKBOOK_", "PYTHON"))}
    return root, env


def _prepare(project, *flags):
    root, env = project
    return subprocess.run([sys.executable, "train.py", "prepare", "--text", "text.txt", "--doc-separator", "\n@@\n",
                           *map(str, flags)], cwd=root, env=env, capture_output=True, text=True,
                          timeout=PREPARE_TIMEOUT_S)


def _refused(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("train.py prepare: error:"), lines
    return lines[0]


def test_train_py_prepare_takes_a_download_folder_and_its_tokenizer_json(project, downloads):
    from transformers import AutoTokenizer

    root, _ = project
    for folder, given in ((downloads.llama3, downloads.llama3),
                          (downloads.llama2, downloads.llama2 / "tokenizer.json")):
        done = _prepare(project, "--out", f"{folder.name}.bin", "--tokenizer", given)
        assert done.returncode == 0, done.stderr
        meta = json.loads((root / f"{folder.name}.bin.json").read_text())
        tokens = np.fromfile(root / f"{folder.name}.bin", dtype=meta["dtype"]).tolist()
        assert tokens == _reference_ids(AutoTokenizer.from_pretrained(folder), DOCS)
        assert "opens with" in done.stderr and "tokenizer_config.json" in done.stderr, "it says where EOS came from"


def test_train_py_prepare_refuses_a_tokenizer_without_an_end_of_text_token_and_takes_eos_token(project):
    from transformers import AutoTokenizer

    root, _ = project
    line = _refused(_prepare(project, "--out", "t.bin", "--tokenizer", "no_eos/tokenizer.json"))
    assert "--eos-token TOKEN" in line and all(t in line for t in data.KNOWN_EOS), line
    assert not (root / "t.bin").exists()
    line = _refused(_prepare(project, "--out", "t.bin", "--tokenizer", "no_eos", "--eos-token", "<|nope|>"))
    assert "<|nope|>" in line, line
    done = _prepare(project, "--out", "t.bin", "--tokenizer", "no_eos", "--eos-token", "<|doc|>")
    assert done.returncode == 0, done.stderr
    meta = json.loads((root / "t.bin.json").read_text())
    tokens = np.fromfile(root / "t.bin", dtype=meta["dtype"]).tolist()
    reopened = AutoTokenizer.from_pretrained(root / meta["tokenizer"])
    assert reopened.eos_token == "<|doc|>" and tokens.count(reopened.eos_token_id) == len(DOCS)
    assert tokens == _reference_ids(reopened, DOCS)


def test_train_py_prepare_writes_the_same_shards_on_two_worker_processes_as_on_one(project, downloads):
    """In a process of its own: spawned workers leave multiprocessing's resource tracker behind until their parent
    exits, which tests/conftest.py would count as a process left by the test."""
    root, _ = project
    made = {}
    for workers in (1, 2):
        done = _prepare(project, "--out", f"w{workers}/tokens.bin", "--tokenizer", downloads.llama3, "--workers",
                        workers, "--shard-tokens", 300)
        assert done.returncode == 0, done.stderr
        made[workers] = sorted((root / f"w{workers}").glob("tokens-*.bin*"))
    assert len(made[1]) > 4 and [p.name for p in made[1]] == [p.name for p in made[2]], "shards and their metadata"
    assert [p.read_bytes() for p in made[1]] == [p.read_bytes() for p in made[2]], "2 processes write 1 process's"
    whole = b"".join(p.read_bytes() for p in made[1] if p.suffix == ".bin")
    done = _prepare(project, "--out", "whole.bin", "--tokenizer", downloads.llama3)
    assert done.returncode == 0 and (root / "whole.bin").read_bytes() == whole, "the shards cut the one file"
