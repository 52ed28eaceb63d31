# From the PyTorch distributed cookbook: the cells tagged 'script:train/data.py' in
#   notebooks/06_checkpointing_and_fault_tolerance.ipynb
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
"""Tokens on disk, windows of them, and a loader whose position is part of the checkpoint.

    python data.py --text a.txt b.txt --out tokens.bin --train-tokenizer 8192    # or: python train.py prepare ...
    python data.py --text a.txt --out tokens.bin --tokenizer Llama-3.2-1B       # a Hugging Face folder or file
    python data.py --text a.txt --out tokens.bin                                 # bytes: vocabulary 256
    python data.py --text web/*.txt --out web.bin --tokenizer Llama-3.2-1B --workers 8 --shard-tokens 100000000

A token file is raw uint8, uint16 or uint32 (the smallest that holds the vocabulary), read with np.memmap (a corpus
larger than memory costs nothing to open), with `OUT.json` beside it: its dtype, vocabulary size, where the
held-out tail for evaluation begins, the end-of-text and beginning-of-sequence tokens and the tokenizer's folder
(`OUT.tokenizer/`, the tokenizer's own files, so the tokens can be turned back into text by this recipe and by
`transformers.AutoTokenizer`). Documents (each text file, or the pieces `--doc-separator` cuts it into) end with
the end-of-text token, and open with the beginning-of-sequence token where the tokenizer has one of its own (Llama's;
GPT-2's is its end-of-text token). The special tokens are the ones the tokenizer's files name (`read_tokenizer`).
`prepare` streams: it reads and tokenizes documents a batch at a time (on `--workers` processes) and writes as it
goes, so its memory does not grow with the corpus; `--shard-tokens` cuts its output into shards (OUT-00000.bin, ...),
each with its metadata and held-out tail.

Several token files made with one tokenizer are shards of one corpus: `train.py --data web-*.bin`. Sources mixed by
weight are `FILES:WEIGHT` each: `--data web.bin:0.7 'code-*.bin:0.3'` (`sources`).

The order of the data is a function of (seed, epoch, global batch) only: a pseudo-random permutation of the
windows per epoch, computed window by window (a Feistel network: no table of the whole permutation in memory), cut
into consecutive global micro-batches, each split among the data-parallel ranks. The sampler's state is (epoch,
windows consumed so far), counted globally, so a checkpoint resumes exactly, and at another data-parallel degree
too, as long as the global batch is unchanged. A mixture's stream (`MixtureSampler`) is a function of (seed,
weights, sizes) alone, its state counted globally too. `fingerprint` describes the data for a checkpoint to
record; `fingerprint_change` says in one line what a resume would find changed.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import json
import math
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32}
EOT = "<|endoftext|>"                                   # the end of a document, in a tokenizer trained here
KNOWN_EOS = (EOT, "</s>", "<|end_of_text|>")           # GPT-2's (and Qwen's), Llama 2's and Mistral's, Llama 3's
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")


def default_corpus_text() -> str:
    """CPython's language reference, shipped with Python (pydoc_data.topics, about 0.8 MB): what the notebooks
    train on."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer (GPT-2's and Llama 3's kind) trained on `texts` with Hugging Face's `tokenizers`:
    it starts from the 256 bytes, so any text encodes, and merges the most frequent pairs until `vocab_size`; the
    end-of-text token is its first special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


@dataclasses.dataclass
class HFTokenizer:
    """A Hugging Face tokenizer as its files define it (`read_tokenizer`): the `tokenizers.Tokenizer`, and what
    preparing data, generating and chat templates need beside it."""
    tokenizer: object                # a tokenizers.Tokenizer
    bos_id: int | None               # beginning of sequence, where the tokenizer has one
    eos_id: int                      # the token that ends a document
    eos_ids: list[int]               # every token generation stops at: generation_config.json's, else [eos_id]
    adds_bos: bool                   # encoding a text puts the BOS first by itself (found by encoding one)
    adds_eos: bool                   # ... and the EOS last
    chat_template: str | None
    files: dict[str, Path]           # file name -> path: the tokenizer files its folder holds
    eos_from: str                    # where eos_id was found: a file's name, --eos-token, or a known spelling

    def document(self, ids: list[int]) -> list[int]:
        """One document's ids (encoded with the tokenizer's own special tokens) as prepare writes them. Llama's
        rule: a document opens with one BOS where the tokenizer has one of its own (added by encoding, else here)
        and ends with one EOS. GPT-2's BOS is its EOS: the EOS ending the previous document opens the next."""
        opens = self.bos_id is not None and self.bos_id != self.eos_id and not self.adds_bos
        return [self.bos_id] * opens + ids + [self.eos_id] * (not self.adds_eos)

    def summary(self) -> str:
        """One line: how a document opens and ends, and where the end-of-text token came from."""
        name = self.tokenizer.id_to_token
        opens = "no BOS" if self.bos_id is None or self.bos_id == self.eos_id else \
            f"{name(self.bos_id)} ({'the tokenizer adds it' if self.adds_bos else 'added here'})"
        return f"each document opens with {opens} and ends with {name(self.eos_id)} (id {self.eos_id}; {self.eos_from})"


def tokenizer_files(path: str | Path) -> dict[str, Path]:
    """The tokenizer files (TOKENIZER_FILES) of a folder, or of the folder of a file named tokenizer.json; a
    tokenizer file under another name (an older token file's OUT.tokenizer.json) stands alone."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such file or folder")
    if path.is_file() and path.name != "tokenizer.json":
        return {"tokenizer.json": path}
    folder = path if path.is_dir() else path.parent
    files = {name: folder / name for name in TOKENIZER_FILES if (folder / name).is_file()}
    if "tokenizer.json" not in files:
        raise ValueError(f"{path}: no tokenizer.json (a Hugging Face tokenizer folder holds one)")
    return files


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None


def _named_token(tokenizer, configs: dict, role: str) -> tuple[int | None, str]:
    """(id, the file naming it) of the `role` ("bos" or "eos") token the tokenizer's files name: tokenizer_config.json's
    or special_tokens_map.json's `role_token` (a string, or an AddedToken's dict), else generation_config.json's
    `role_token_id` (the first of a list); (None, "") where none does."""
    for file in ("tokenizer_config.json", "special_tokens_map.json"):
        value = configs.get(file, {}).get(f"{role}_token")
        name = value.get("content") if isinstance(value, dict) else value
        if isinstance(name, str) and name:
            if tokenizer.token_to_id(name) is None:
                raise ValueError(f"{file} names {name!r} as the {role.upper()} token, which the vocabulary lacks")
            return tokenizer.token_to_id(name), file
    ids = configs.get("generation_config.json", {}).get(f"{role}_token_id")
    ids = ids[0] if isinstance(ids, list) and ids else ids
    return (ids, "generation_config.json") if isinstance(ids, int) else (None, "")


def read_tokenizer(path: str | Path, eos_token: str | None = None) -> HFTokenizer:
    """The tokenizer of a Hugging Face folder (or of its tokenizer.json), its special tokens as its own files name
    them (`_named_token`), its chat template from chat_template.jinja or tokenizer_config.json (transformers 5
    writes the first, the Hub's downloads hold the second). A tokenizer.json alone finds its BOS by encoding a text
    and falls back to a known spelling of the end of text (KNOWN_EOS; `eos_from` says so). `eos_token` names the
    end-of-document token instead. ValueError, one line: no end-of-text token, a token the vocabulary lacks, a file
    that does not parse."""
    from tokenizers import Tokenizer

    files = tokenizer_files(path)
    try:
        tokenizer = Tokenizer.from_file(str(files["tokenizer.json"]))
    except Exception as e:              # the tokenizers package raises its own exception type for a bad file
        raise ValueError(f"{files['tokenizer.json']}: {str(e).splitlines()[0]}") from None
    configs = {name: _read_json(file) for name, file in files.items() if name.endswith("config.json")
               or name == "special_tokens_map.json"}
    template = files["chat_template.jinja"].read_text(encoding="utf-8") if "chat_template.jinja" in files else \
        configs.get("tokenizer_config.json", {}).get("chat_template")
    if isinstance(template, list):      # several named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    try:
        return from_tokenizer(tokenizer, eos_token, configs, files, template)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def from_tokenizer(tokenizer, eos_token: str | None = None, configs: dict | None = None, files: dict | None = None,
                   chat_template: str | None = None) -> HFTokenizer:
    """An HFTokenizer from a `tokenizers.Tokenizer` and what its files say (`configs`: file name -> its JSON):
    the BOS and EOS its files name, else the BOS encoding adds and a known spelling of the end of text."""
    configs = configs or {}
    plain, full = (tokenizer.encode("Hello world", add_special_tokens=s).ids for s in (False, True))
    head = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), 0)
    added_first, added_last = full[:head], full[head + len(plain):]
    bos_id, _ = _named_token(tokenizer, configs, "bos")
    bos_id = bos_id if bos_id is not None or not added_first else added_first[0]
    if eos_token is not None:
        eos_id, eos_from = tokenizer.token_to_id(eos_token), "--eos-token"
        if eos_id is None:
            raise ValueError(f"--eos-token {eos_token}: not a token of the vocabulary")
    else:
        eos_id, eos_from = _named_token(tokenizer, configs, "eos")
    if eos_id is None:
        known = [t for t in KNOWN_EOS if tokenizer.token_to_id(t) is not None]
        if not known:
            raise ValueError("no end-of-text token named (no eos_token in tokenizer_config.json or "
                             "special_tokens_map.json, no eos_token_id in generation_config.json, none of "
                             f"{', '.join(KNOWN_EOS)} in the vocabulary): name the token that ends a document "
                             "with --eos-token TOKEN")
        eos_id, eos_from = tokenizer.token_to_id(known[0]), "a known spelling: its files name none"
    listed = configs.get("generation_config.json", {}).get("eos_token_id")
    eos_ids = [listed] if isinstance(listed, int) else list(listed) if listed else [eos_id]
    return HFTokenizer(tokenizer, bos_id, eos_id, eos_ids, bos_id is not None and bos_id in added_first,
                       eos_id in added_last, chat_template, dict(files or {}), eos_from)


def save_tokenizer(tok: HFTokenizer, folder: Path) -> None:
    """`tok`'s files copied verbatim into `folder`; where its source had none (a tokenizer trained here, a
    tokenizer.json alone) or named another EOS (--eos-token), a tokenizer_config.json naming its BOS and EOS and a
    generation_config.json with their ids, so that `transformers.AutoTokenizer.from_pretrained(folder)` opens the
    tokenizer the tokens were made with and `read_tokenizer(folder)` reads back this one."""
    partial = folder.with_name(f".{folder.name}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for name, source in tok.files.items():
        shutil.copyfile(source, partial / name)
    if "tokenizer.json" not in tok.files:
        tok.tokenizer.save(str(partial / "tokenizer.json"))
    name = tok.tokenizer.id_to_token
    bos = name(tok.bos_id) if tok.bos_id is not None else None
    config = _read_json(tok.files["tokenizer_config.json"]) if "tokenizer_config.json" in tok.files else \
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos}
    if _named_token(tok.tokenizer, {"tokenizer_config.json": config}, "eos")[0] != tok.eos_id:
        (partial / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": name(tok.eos_id)}, indent=2))
    if "generation_config.json" not in tok.files:
        eos = tok.eos_ids if len(tok.eos_ids) > 1 else tok.eos_id
        (partial / "generation_config.json").write_text(json.dumps({"bos_token_id": tok.bos_id, "eos_token_id": eos}))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(partial, folder)


def read_documents(paths: list, separator: str | None = None, chunk_chars: int = 1 << 20):
    """The documents of UTF-8 text files, one at a time: each file one document, or the pieces `separator` cuts it
    into (blank ones dropped), read `chunk_chars` at a time. Memory: a chunk and the document being read."""
    for path in paths:
        with open(path, encoding="utf-8") as f:
            if not separator:
                yield f.read()
                continue
            rest = ""
            while chunk := f.read(chunk_chars):
                *done, rest = (rest + chunk).split(separator)
                yield from (doc for doc in done if doc.strip())
            if rest.strip():
                yield rest


def _batches(documents, batch_chars: int):
    """Lists of consecutive documents of about `batch_chars` characters (one longer document alone)."""
    batch, size = [], 0
    for doc in documents:
        batch.append(doc)
        size += len(doc)
        if size >= batch_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encode(tokenizer: HFTokenizer | None, batch: list[str], dtype) -> np.ndarray:
    """A batch of documents as the token file holds them: each encoded, opened and ended (`HFTokenizer.document`);
    without a tokenizer their UTF-8 bytes, joined by blank lines."""
    if tokenizer is None:
        return np.frombuffer("\n\n".join(batch).encode("utf-8"), dtype=np.uint8)
    return np.concatenate([np.asarray(tokenizer.document(e.ids), dtype=dtype)
                           for e in tokenizer.tokenizer.encode_batch(batch)])


_worker_state: tuple = ()       # (tokenizer, dtype) in a worker process of `_encoded`


def _start_worker(tokenizer: HFTokenizer, dtype) -> None:
    global _worker_state
    os.environ["TOKENIZERS_PARALLELISM"] = "false"       # the processes are the parallelism: a thread pool each
    _worker_state = (tokenizer, dtype)                   # would oversubscribe the cores


def _encode_in_worker(batch: list[str]) -> np.ndarray:
    return _encode(_worker_state[0], batch, _worker_state[1])


def _encoded(batches, tokenizer: HFTokenizer | None, dtype, workers: int):
    """The token arrays of `batches`, in their order: encoded here, or by `workers` processes, at most two batches
    per worker in flight, so that memory stays bounded whatever the corpus; the same arrays either way (each
    document is encoded alone). The processes are spawned (a fork of a process that has run torch's or tokenizers'
    threads is not safe), so a script that calls this needs `if __name__ == "__main__":`, as multiprocessing says."""
    if workers == 1 or tokenizer is None:
        yield from (_encode(tokenizer, batch, dtype) for batch in batches)
        return
    import collections
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    pool = ProcessPoolExecutor(workers, multiprocessing.get_context("spawn"), _start_worker, (tokenizer, dtype))
    try:
        pending = collections.deque()
        for batch in batches:
            pending.append(pool.submit(_encode_in_worker, batch))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:                    # done, an error, or the caller stopped reading: no worker outlives this
        pool.shutdown(wait=True, cancel_futures=True)


class _TokenFiles:
    """Tokens appended as they come to `out`, or, with `shard_tokens`, to OUT-00000.bin, OUT-00001.bin, ... (OUT
    the name without its suffix) of `shard_tokens` each (the last one fewer). A file is written under a temporary
    name and renamed when complete, then its metadata: `common`, its count and its held-out tail (the last
    `eval_fraction` of its tokens, so that every shard has one)."""

    def __init__(self, out: Path, dtype, common: dict, eval_fraction: float, shard_tokens: int | None):
        self.out, self.dtype, self.common = out, dtype, common
        self.eval_fraction, self.shard_tokens = eval_fraction, shard_tokens
        self.paths, self.file, self.count, self.total = [], None, 0, 0

    def name(self, index: int) -> Path:
        return self.out if self.shard_tokens is None else \
            self.out.with_name(f"{self.out.stem}-{index:05d}{self.out.suffix}")

    def write(self, tokens: np.ndarray) -> None:
        while len(tokens):
            if self.file is None:
                self.partial = self.out.with_name(f".{self.name(len(self.paths)).name}.{os.getpid()}.partial")
                self.file, self.count = open(self.partial, "wb"), 0
            room = len(tokens) if self.shard_tokens is None else self.shard_tokens - self.count
            piece, tokens = tokens[:room], tokens[room:]
            piece.tofile(self.file)
            self.count, self.total = self.count + len(piece), self.total + len(piece)
            if self.count == self.shard_tokens:
                self._finish()

    def _finish(self) -> None:
        self.file.close()
        path, self.file = self.name(len(self.paths)), None
        os.replace(self.partial, path)
        meta = {"dtype": np.dtype(self.dtype).name, "tokens": self.count,
                "eval_start": int(self.count * (1 - self.eval_fraction)), **self.common}
        _write_atomically(meta_path(path), lambda p: p.write_text(json.dumps(meta)))
        self.paths.append(path)

    def close(self, failed: bool = False) -> list[Path]:
        """The files written (the one under way finished, unless `failed`: then removed); ValueError for no text.
        With shards, an earlier prepare's shards past the last one written are removed."""
        if self.file is not None and (failed or self.total < 2):
            self.file.close()
            os.remove(self.partial)
            self.file = None
        if not failed and self.total < 2:
            raise ValueError("the text is empty")
        if self.file is not None:
            self._finish()
        if self.shard_tokens and not failed:
            for stale in self.out.parent.glob(f"{self.out.stem}-[0-9][0-9][0-9][0-9][0-9]{self.out.suffix}"):
                if int(stale.stem[-5:]) >= len(self.paths):
                    stale.unlink()
                    meta_path(stale).unlink(missing_ok=True)
        return self.paths


def _write_atomically(path: Path, write) -> None:
    """write(temporary path), then rename: two ranks preparing at once, or a crash, never leave a half file."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    write(partial)
    os.replace(partial, path)


def prepare(documents, out: str | Path, eval_fraction: float = 0.05, tokenizer=None, workers: int = 1,
            batch_chars: int = 1 << 20) -> Path:
    """Write the tokens of `documents` (an iterable of strings, read as it goes) to the token file `out`, with its
    metadata (OUT.json) and held-out tail (its last `eval_fraction`); returns `out`. With a tokenizer (a folder or
    tokenizer.json, a `tokenizers.Tokenizer` or an HFTokenizer) each document is opened and ended as
    `HFTokenizer.document` says, and the tokenizer's files go to the folder OUT.tokenizer; without one the tokens
    are the documents' UTF-8 bytes joined by blank lines (vocabulary 256). Batches of about `batch_chars`
    characters are encoded here or by `workers` processes and written as they come: memory holds a few batches
    and the longest document, whatever the corpus; any number of workers writes the same file."""
    return prepare_shards(documents, out, None, eval_fraction, tokenizer, workers, batch_chars)[0]


def prepare_shards(documents, out: str | Path, shard_tokens: int | None, eval_fraction: float = 0.05,
                   tokenizer=None, workers: int = 1, batch_chars: int = 1 << 20) -> list[Path]:
    """`prepare`, the tokens cut into shards of `shard_tokens` (OUT-00000.bin, ...: `_TokenFiles`), each with its
    metadata and held-out tail, one tokenizer folder (OUT.tokenizer) for all; returns the shards."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if shard_tokens is not None and shard_tokens < 2:
        raise ValueError(f"--shard-tokens {shard_tokens}: a shard needs at least 2 tokens")
    common, dtype = {"vocab_size": 256, "eot_id": None, "bos_id": None, "tokenizer": None}, np.uint8
    if tokenizer is not None:
        if not isinstance(tokenizer, HFTokenizer):
            tokenizer = read_tokenizer(tokenizer) if isinstance(tokenizer, (str, Path)) else from_tokenizer(tokenizer)
        folder, vocab = out.with_name(out.name + ".tokenizer"), tokenizer.tokenizer.get_vocab_size()
        save_tokenizer(tokenizer, folder)
        common = {"vocab_size": vocab, "eot_id": tokenizer.eos_id, "bos_id": tokenizer.bos_id, "tokenizer": folder.name}
        dtype = np.uint16 if vocab <= 2 ** 16 else np.uint32
    files = _TokenFiles(out, dtype, common, eval_fraction, shard_tokens)
    try:
        for i, tokens in enumerate(_encoded(_batches(documents, batch_chars), tokenizer, dtype, workers)):
            if tokenizer is None and i:
                files.write(np.frombuffer(b"\n\n", dtype=np.uint8))     # between batches as within one
            files.write(tokens)
    except BaseException:
        files.close(failed=True)
        raise
    return files.close()


def meta_path(tokens_file: str | Path) -> Path:
    return Path(str(tokens_file) + ".json")


def read_meta(path: str | Path) -> dict:
    return json.loads(meta_path(path).read_text())


@dataclasses.dataclass(frozen=True)
class Source:
    """One corpus of the training data: its token files (shards) and its weight (its share of the windows drawn)."""
    files: tuple[Path, ...]
    weight: float


def sources(data: list) -> list[Source]:
    """train.py's --data, read. Token files alone are shards of one corpus (`a.bin b.bin`); sources mixed by weight
    are `FILES:WEIGHT` each (`web.bin:0.7 'code-*.bin:0.3'`), FILES a token file, a comma-separated list of them or
    a glob of shards (quoted, for the shell to leave it), the weights relative. ValueError, one line: a missing
    file, a weight that is not a positive number, weights on some sources and not on others."""
    parsed = []
    for item in map(str, data):
        files, colon, weight = item.rpartition(":")
        try:
            parsed.append((files, float(weight)) if colon else (item, None))
        except ValueError:                     # a colon inside a path
            parsed.append((item, None))
    weights = [w for _, w in parsed if w is not None]
    if weights and len(weights) < len(parsed):
        raise ValueError("--data: give every source a weight (FILES:WEIGHT) or none (token files alone are shards "
                         "of one corpus)")
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError(f"--data: a weight is a positive number, got {', '.join(map(str, weights))}")
    groups = [[f for pattern in files.split(",") for f in _token_files(pattern)] for files, _ in parsed]
    if not weights:
        return [Source(tuple(f for group in groups for f in group), 1.0)]
    return [Source(tuple(group), w / sum(weights)) for group, (_, w) in zip(groups, parsed)]


def _token_files(pattern: str) -> list[Path]:
    """The token file named, or the files a glob matches, sorted; ValueError where there is none."""
    names = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
    missing = [n for n in names if not (Path(n).is_file() and meta_path(n).is_file())]
    if not names or missing:
        raise ValueError(f"--data {', '.join(missing) or pattern}: no such token file (make one with: python "
                         "train.py prepare --text ... --out ...)")
    return [Path(n) for n in names]


def vocab_size(data: list) -> int:
    """The vocabulary of token files made with one tokenizer; ValueError if they were not."""
    paths = [p for source in sources(data) for p in source.files]
    metas = [read_meta(p) for p in paths]
    if len({(m["vocab_size"], m.get("eot_id"), m.get("bos_id")) for m in metas}) > 1:
        raise ValueError(f"the token files {[str(p) for p in paths]} were made with different tokenizers")
    return metas[0]["vocab_size"]


def describe(data: list) -> dict:
    """What a checkpoint records of its data: the files (and the sources, each a weight and its files), and the
    tokenizer (its folder, `read_tokenizer` reads it; an older token file's tokenizer.json) and end-of-text token
    that turn its ids back into text."""
    mixture = sources(data)
    first = mixture[0].files[0]
    tokenizer = read_meta(first).get("tokenizer")
    return {"files": [str(p.resolve()) for source in mixture for p in source.files],
            "sources": [{"files": [str(p.resolve()) for p in s.files], "weight": s.weight} for s in mixture],
            "tokenizer": str((first.parent / tokenizer).resolve()) if tokenizer else None,
            "vocab_size": vocab_size(data), "eot_id": read_meta(first).get("eot_id")}


def load_tokens(path: str | Path, split: str) -> np.ndarray:
    """The train or eval part of a token file, memory-mapped (read-only, nothing loaded yet)."""
    meta = read_meta(path)
    tokens = np.memmap(path, dtype=DTYPES[meta["dtype"]], mode="r", shape=(meta["tokens"],))
    return tokens[:meta["eval_start"]] if split == "train" else tokens[meta["eval_start"]:]


class TokenWindows(torch.utils.data.Dataset):
    """Non-overlapping windows of seq_len tokens and their next tokens, over one or more token arrays (shards; no
    window crosses from one to the next): item i is (x, y), y = x shifted by one."""

    def __init__(self, shards: list[np.ndarray], seq_len: int):
        self.shards, self.seq_len = shards, seq_len
        counts = [max(0, len(t) - 1) // seq_len for t in shards]
        self.starts = np.cumsum([0] + counts)          # the first window of each shard
        self.n = int(self.starts[-1])
        if self.n < 1:
            raise ValueError(f"{sum(len(t) for t in shards)} tokens make no window of {seq_len}")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        shard = int(np.searchsorted(self.starts, i, side="right")) - 1
        start = (i - int(self.starts[shard])) * self.seq_len
        chunk = torch.from_numpy(self.shards[shard][start:start + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def _round(half: np.ndarray, key: int, round_index: int) -> np.ndarray:
    """A round of the Feistel network: splitmix64's finaliser of (half, key, round), a well-mixed 64-bit hash."""
    z = half + np.uint64(key & 0xFFFFFFFFFFFF) * _MIX[0] + np.uint64(round_index + 1) * _MIX[1]
    z = (z ^ (z >> np.uint64(30))) * _MIX[1]
    z = (z ^ (z >> np.uint64(27))) * _MIX[2]
    return z ^ (z >> np.uint64(31))


def permute(indices: np.ndarray, n: int, key: int) -> np.ndarray:
    """Where each of `indices` (in range(n)) goes under a pseudo-random permutation of range(n) chosen by `key`,
    computed for these indices alone: four Feistel rounds are a bijection of the 2^(2h) numbers of 2h bits (the
    smallest even width covering n), and a result >= n goes through the rounds again ("cycle walking") until it
    lands in range(n), which keeps it a bijection of range(n) (fewer than 4 tries on average)."""
    half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
    shift, mask = np.uint64(half_bits), np.uint64((1 << half_bits) - 1)
    x = np.asarray(indices, dtype=np.uint64).copy()
    todo = np.ones(len(x), dtype=bool)
    with np.errstate(over="ignore"):                        # the hash multiplies modulo 2^64 on purpose
        while todo.any():
            left, right = x[todo] >> shift, x[todo] & mask
            for r in range(4):
                left, right = right, left ^ (_round(right, key, r) & mask)
            x[todo] = (left << shift) | right
            todo = x >= np.uint64(n)
    return x.astype(np.int64)


class GlobalBatchSampler:
    """An endless, stateful batch sampler: yields this data-parallel rank's share (`local` window indices) of each
    global micro-batch (`local * dp_size` consecutive positions of the epoch's permutation). Its state counts
    windows globally, so it is the same on every rank and at every data-parallel degree. StatefulDataLoader saves
    it (it is its own iterator, with state_dict/load_state_dict). Memory: one micro-batch of indices, whatever the
    corpus (a table of the permutation would take 8 bytes per window, on every rank)."""

    def __init__(self, n_windows: int, local: int, dp_rank: int, dp_size: int, global_batch: int, seed: int = 0):
        self.n, self.local, self.dp_rank, self.dp_size, self.seed = n_windows, local, dp_rank, dp_size, seed
        self.per_epoch = n_windows // global_batch * global_batch   # whole optimizer steps only
        if self.per_epoch == 0:
            raise ValueError(f"{n_windows} training windows make no global batch of {global_batch}")
        self.epoch, self.consumed = 0, 0

    def __iter__(self):
        return self

    def __next__(self) -> list[int]:
        if self.consumed >= self.per_epoch:
            self.epoch, self.consumed = self.epoch + 1, 0
        start = self.consumed + self.dp_rank * self.local
        self.consumed += self.local * self.dp_size
        positions = np.arange(start, start + self.local)
        return permute(positions, self.n, self.seed * 7919 + self.epoch).tolist()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])


class MixtureSampler:
    """GlobalBatchSampler's counterpart for several sources drawn by weight. Position p of the global stream of
    windows goes to the source furthest below its share, w_s * (p + 1) - drawn_s largest (Megatron's blending:
    every stretch of the stream holds each share to a window), and a source's k-th draw is position k of its own
    shuffle (`permute`, keyed by the seed, the source and its epoch k // n_s): a small source repeats, epoch after
    epoch, while a large one is partly seen. Its state counts globally (windows consumed, each source's draws), so
    the stream is a function of (seed, weights, sizes) alone: a resume is exact at any data-parallel degree."""

    def __init__(self, sizes: list[int], weights: list[float], local: int, dp_rank: int, dp_size: int,
                 seed: int = 0):
        self.sizes, self.weights = np.asarray(sizes, dtype=np.int64), np.asarray(weights, dtype=np.float64)
        self.starts = np.cumsum([0] + list(sizes))[:-1]          # the first window of each source
        self.local, self.dp_rank, self.dp_size, self.seed = local, dp_rank, dp_size, seed
        self.consumed, self.drawn = 0, np.zeros(len(sizes), dtype=np.int64)

    def __iter__(self):
        return self

    def __next__(self) -> list[int]:
        drawn, picks = self.drawn.copy(), []                     # the global micro-batch: (source, its draw k)
        for p in range(self.consumed, self.consumed + self.local * self.dp_size):
            s = int(np.argmax(self.weights * (p + 1) - drawn))
            picks.append((s, int(drawn[s])))
            drawn[s] += 1
        self.consumed, self.drawn = self.consumed + len(picks), drawn
        mine = picks[self.dp_rank * self.local:(self.dp_rank + 1) * self.local]
        return [int(self.starts[s]) + self.window(s, k) for s, k in mine]

    def window(self, source: int, k: int) -> int:
        """The source's k-th draw: a window of it, in its own order of epoch k // size."""
        n = int(self.sizes[source])
        key = (self.seed * 7919 + k // n) * 65537 + source
        return int(permute(np.array([k % n]), n, key)[0])

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "drawn": self.drawn.tolist()}

    def load_state_dict(self, state: dict) -> None:
        if len(state.get("drawn", ())) != len(self.sizes):
            raise ValueError(f"the saved data position is not of a mixture of {len(self.sizes)} sources")
        self.consumed, self.drawn = int(state["consumed"]), np.asarray(state["drawn"], dtype=np.int64)


def train_loader(data: list, seq_len: int, local_batch: int, dp_rank: int, dp_size: int, global_batch: int,
                 seed: int = 0):
    """torchdata's StatefulDataLoader over the training windows of --data (`sources`): one source's through
    GlobalBatchSampler, several mixed by weight through MixtureSampler. `next(iter(loader))` is this rank's
    micro-batch, and `loader.state_dict()` its exact position (kept in the checkpoint)."""
    mixture = sources(data)
    shards = [[load_tokens(p, "train") for p in source.files] for source in mixture]
    windows = TokenWindows([tokens for group in shards for tokens in group], seq_len)
    first = np.cumsum([0] + [len(group) for group in shards])            # each source's first shard
    sizes = [int(windows.starts[b] - windows.starts[a]) for a, b in zip(first[:-1], first[1:])]
    for source, size in zip(mixture, sizes):
        if size == 0:
            raise ValueError(f"{', '.join(map(str, source.files))}: no training window of {seq_len} tokens")
    if len(mixture) == 1:
        sampler = GlobalBatchSampler(len(windows), local_batch, dp_rank, dp_size, global_batch, seed)
    else:
        sampler = MixtureSampler(sizes, [s.weight for s in mixture], local_batch, dp_rank, dp_size, seed)
    return _stateful_loader(windows, sampler, seed)


def _stateful_loader(windows, sampler, seed: int):
    """A StatefulDataLoader of `windows` in `sampler`'s order. Its own generator: each `iter(loader)` draws a seed,
    which would otherwise come from the global generator and shift the draws of dropout after a resume."""
    import warnings

    from torchdata.stateful_dataloader import StatefulDataLoader

    with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, which newer torch deprecates
        warnings.filterwarnings("ignore", message=".*set_vital")
        return StatefulDataLoader(windows, batch_sampler=sampler, num_workers=0,
                                  generator=torch.Generator().manual_seed(seed))


def eval_batches(data: list, seq_len: int, local_batch: int, dp_rank: int, dp_size: int, max_windows: int):
    """The held-out windows, this rank's share in batches: at most `max_windows`, taken from every shard's tail in
    turn (the first window of each shard, then the second, ...), the same set at every layout, so the evaluation
    loss is comparable between layouts and speaks for the whole corpus, not for its first shard."""
    windows = TokenWindows([load_tokens(p, "eval") for s in sources(data) for p in s.files], seq_len)
    return _held_out_batches(windows, local_batch, dp_rank, dp_size, max_windows)


def _held_out_batches(windows, local_batch: int, dp_rank: int, dp_size: int, max_windows: int):
    """eval_batches' order over any windows with `starts` (each shard's first window)."""
    counts, order, depth = np.diff(windows.starts), [], 0
    while len(order) < min(len(windows), max_windows):
        order += [int(windows.starts[s]) + depth for s in np.flatnonzero(counts > depth)]
        depth += 1
    n = min(len(order), max_windows) // dp_size * dp_size
    if n == 0:
        raise ValueError(f"the held-out tail has {len(windows)} windows of {windows.seq_len}: fewer than {dp_size} "
                         "ranks")
    mine = order[dp_rank:n:dp_size]
    for i in range(0, len(mine), local_batch):
        items = [windows[j] for j in mine[i:i + local_batch]]
        yield tuple(torch.stack(parts) for parts in zip(*items))     # (inputs, targets[, positions])


def fingerprint(data: list, seq_len: int, seed: int) -> dict:
    """What a resume must find unchanged to go on with the same stream of windows (JSON, for the checkpoint): each
    source's weight and token files, in order, by name (the folder may move), size and a hash of the metadata
    (token count, dtype, tokenizer, held-out split; hashing the tokens would read the corpus), --seq-len (the
    windows) and the seed (their order)."""
    def file(path: Path) -> dict:
        meta = hashlib.sha256(meta_path(path).read_bytes()).hexdigest()
        return {"name": path.name, "bytes": path.stat().st_size, "meta_sha256": meta}
    return {"sources": [{"weight": s.weight, "files": [file(p) for p in s.files]} for s in sources(data)],
            "seq_len": seq_len, "seed": seed}


def fingerprint_change(saved: dict, now: dict) -> str | None:
    """None where a checkpoint's data fingerprint and this run's agree; else one line saying what changed."""
    for key, flag in (("seq_len", "--seq-len"), ("seed", "--seed")):
        if saved[key] != now[key]:
            return f"{flag} was {saved[key]}, now {now[key]}"
    before, after = saved["sources"], now["sources"]
    if len(before) != len(after) or not all(math.isclose(a["weight"], b["weight"], rel_tol=1e-9)
                                            for a, b in zip(before, after)):
        weights = (", ".join(f"{s['weight']:.4g}" for s in side) for side in (before, after))
        return "the data's sources (their weights) were {}, now {}".format(*weights)
    for a, b in zip(before, after):
        names = [[f["name"] for f in side["files"]] for side in (a, b)]
        if names[0] != names[1]:
            gone, new = sorted(set(names[0]) - set(names[1])), sorted(set(names[1]) - set(names[0]))
            what = [f"gone: {', '.join(gone)}"] * bool(gone) + [f"new: {', '.join(new)}"] * bool(new)
            return f"the token files changed ({'; '.join(what) or 'their order'})"
        changed = [f["name"] for f, g in zip(a["files"], b["files"]) if f != g]
        if changed:
            return f"{', '.join(changed)} changed (its size or metadata differ)"
    return None


# ------------------------------------------------------------------------- supervised fine-tuning: conversations
from model import IGNORE_INDEX  # noqa: E402  (notebook 03's loss: a target that is none)

# Each role's message, then the end-of-sequence token (an assistant's ends its turn): for a tokenizer without a
# chat template of its own (Llama 2's, GPT-2's, one trained here).
DEFAULT_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}{{- message['role'] + ': ' + message['content'] | trim + eos_token }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}")


_COMPILED: dict = {}      # chat template -> compiled: rendered twice per assistant turn


def _chat_template(source: str):
    """A chat template compiled as transformers' apply_chat_template compiles it: a sandboxed Jinja2 environment
    with trim_blocks and lstrip_blocks, the loop controls, `raise_exception`, a `tojson` that keeps non-ASCII
    text, and `strftime_now` (fixed when compiled, so that every prefix of a conversation renders the same date)."""
    from datetime import datetime

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    if source not in _COMPILED:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception, strftime_now=datetime.now().strftime)
        _COMPILED[source] = env.from_string(source)
    return _COMPILED[source]


def render_chat(tok: HFTokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """A conversation as text, written by the tokenizer's chat template (else DEFAULT_CHAT_TEMPLATE) with the
    variables transformers passes: messages, bos_token and eos_token (as text), add_generation_prompt, and no tools
    or documents. The template writes the special tokens: encode the text without adding any."""
    name = tok.tokenizer.id_to_token
    if tok.chat_template:
        bos = name(tok.bos_id) if tok.bos_id is not None else ""
        template = tok.chat_template
    else:                     # the default opens with BOS only where it is not the EOS (GPT-2's is)
        bos = name(tok.bos_id) if tok.bos_id not in (None, tok.eos_id) else ""
        template = DEFAULT_CHAT_TEMPLATE
    return _chat_template(template).render(messages=messages, bos_token=bos, eos_token=name(tok.eos_id),
                                           add_generation_prompt=add_generation_prompt, tools=None, documents=None)


def conversation_tokens(tok: HFTokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """The token ids of a conversation (its whole rendering encoded, as apply_chat_template encodes it) and, per
    token, whether it is a target: whether it ends inside an assistant turn, the turn's text and its end-of-turn
    token. A turn's characters are found by rendering prefixes of the conversation: the messages before it with
    the generation prompt (the header the model answers after) end where the turn begins, the messages through it
    end where it ends. Robust to tokens that merge across the edges; a template that does not write a
    conversation prefix by prefix (one that changes earlier turns when later ones come) is refused."""
    text = render_chat(tok, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            before, through = render_chat(tok, messages[:i], True), render_chat(tok, messages[:i + 1])
            if not (text.startswith(through) and through.startswith(before)):
                raise ValueError(f"the chat template does not write the conversation prefix by prefix (turn {i})")
            spans.append((len(before), len(through)))
    encoding = tok.tokenizer.encode(text, add_special_tokens=False)
    return encoding.ids, [any(a < end <= b for a, b in spans) for _, end in encoding.offsets]


def read_conversations(path: str | Path) -> list[list[dict]]:
    """A JSON-lines file of conversations as the chat data sets on the Hub store them: one object per line, its
    `messages` a list of {"role", "content"} (roles system, user, assistant). ValueError names the line."""
    conversations = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            messages = json.loads(line)["messages"]
            if not all(isinstance(m["role"], str) and isinstance(m["content"], str) for m in messages):
                raise TypeError("a role or a content is not a string")
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}, line {number}: not a conversation "
                             f'({{"messages": [{{"role": ..., "content": ...}}, ...]}}): {e}') from None
        conversations.append(messages)
    return conversations


def sft_file(tokens_file: str | Path, part: str) -> Path:
    """Beside an SFT token file: OUT.targets (a byte per token, 1 for a target) or OUT.starts (each conversation's
    first token, int64, and the end)."""
    return Path(f"{tokens_file}.{part}")


def prepare_sft(conversations: list[list[dict]], out: str | Path, tokenizer, eval_fraction: float = 0.05) -> Path:
    """Write conversations for supervised fine-tuning: their tokens, one conversation after another, to `out` (the
    token file's format, read by load_tokens), which tokens are targets to `out`.targets, where each conversation
    begins to `out`.starts, the metadata to `out`.json (with an "sft" entry) and the tokenizer's folder beside them.
    `tokenizer`: an HFTokenizer, or a folder read_tokenizer reads. The last `eval_fraction` of the conversations
    (at least one) is held out. A conversation with no target past its first token teaches nothing: left out."""
    import jinja2

    tok = tokenizer if isinstance(tokenizer, HFTokenizer) else read_tokenizer(tokenizer)
    vocab = tok.tokenizer.get_vocab_size()
    dtype = np.uint16 if vocab <= 2 ** 16 else np.uint32
    ids, targets, starts = [], [], [0]
    for number, messages in enumerate(conversations, 1):
        try:
            t, m = conversation_tokens(tok, messages)
        except jinja2.TemplateError as e:
            raise ValueError(f"conversation {number}: the chat template refused it: {e}") from None
        if any(m[1:]):
            ids.append(np.array(t, dtype=dtype))
            targets.append(np.array(m, dtype=np.uint8))
            starts.append(starts[-1] + len(t))
    n = len(ids)
    held = max(1, round(n * eval_fraction))
    if n - held < 1:
        raise ValueError(f"{n} conversation(s) with an assistant turn: too few to hold {held} out and train on more")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    folder = out.with_name(out.name + ".tokenizer")
    save_tokenizer(tok, folder)
    tokens, targets = np.concatenate(ids), np.concatenate(targets)
    meta = {"dtype": tokens.dtype.name, "vocab_size": vocab, "tokens": int(len(tokens)), "eval_start": starts[n - held],
            "eot_id": tok.eos_id, "bos_id": tok.bos_id, "tokenizer": folder.name,
            "sft": {"conversations": n, "held_out": held, "left_out": len(conversations) - n,
                    "targets": int(targets.sum()), "chat_template": "its own" if tok.chat_template else "the default"}}
    _write_atomically(sft_file(out, "targets"), targets.tofile)
    _write_atomically(sft_file(out, "starts"), np.array(starts, dtype=np.int64).tofile)
    _write_atomically(out, tokens.tofile)
    _write_atomically(meta_path(out), lambda p: p.write_text(json.dumps(meta)))    # last: the file is complete
    return out


class PackedConversations(torch.utils.data.Dataset):
    """Windows of seq_len tokens over SFT token files (prepare_sft; several are shards, no window spans two), each
    of whole conversations (pack), item i (inputs, targets, positions): a target is the next token where that one
    is a target, IGNORE_INDEX elsewhere (prompts, a conversation's last token, padding); positions restart at 0 with
    each conversation and with the padding that fills the tail (Llama.forward's `positions`). A conversation longer
    than seq_len is truncated to its first seq_len tokens (counted in `truncated`), or left out where no target is
    left (`dropped`)."""

    def __init__(self, paths: list, seq_len: int, split: str):
        self.seq_len, self.shards, self.truncated, self.dropped = seq_len, [], 0, 0
        for path in paths:
            meta = read_meta(path)
            if "sft" not in meta:
                raise ValueError(f"{path} holds no conversations: make it with `train.py prepare --sft`")
            starts = np.fromfile(sft_file(path, "starts"), dtype=np.int64)
            cut = int(np.searchsorted(starts, meta["eval_start"]))
            starts = starts[:cut + 1] if split == "train" else starts[cut:]
            targets = np.memmap(sft_file(path, "targets"), dtype=np.uint8, mode="r", shape=(meta["tokens"],))
            lengths, keep = np.diff(starts), np.ones(len(starts) - 1, dtype=bool)
            for i in np.flatnonzero(lengths > seq_len):
                keep[i] = targets[starts[i] + 1:starts[i] + seq_len].any()
                self.truncated, self.dropped = self.truncated + int(keep[i]), self.dropped + int(not keep[i])
            begin, lengths = starts[:-1][keep], np.minimum(lengths[keep], seq_len)
            tokens = np.memmap(path, dtype=DTYPES[meta["dtype"]], mode="r", shape=(meta["tokens"],))
            self.shards.append((tokens, targets, begin, lengths, pack(lengths, seq_len), meta.get("eot_id") or 0))
        self.starts = np.cumsum([0] + [len(shard[4]) - 1 for shard in self.shards])    # each shard's first window
        self.n = int(self.starts[-1])
        if self.n < 1:
            raise ValueError(f"the {split} conversations of {[str(p) for p in paths]} make no window")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        shard = int(np.searchsorted(self.starts, i, side="right")) - 1
        tokens, targets, begin, lengths, first, pad = self.shards[shard]
        w = i - int(self.starts[shard])
        x, y = np.full(self.seq_len, pad, dtype=np.int64), np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        positions, at = np.zeros(self.seq_len, dtype=np.int64), 0
        for c in range(first[w], first[w + 1]):
            s, n = int(begin[c]), int(lengths[c])
            x[at:at + n] = tokens[s:s + n]
            y[at:at + n - 1] = np.where(targets[s + 1:s + n] == 1, x[at + 1:at + n], IGNORE_INDEX)
            positions[at:at + n] = np.arange(n)
            at += n
        positions[at:] = np.arange(self.seq_len - at)       # the padding: a sequence of its own, no targets
        return torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(positions)


def pack(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Greedy packing in file order (next fit): a window takes whole conversations while they fit in seq_len tokens;
    a conversation longer than that fills a window alone (truncated by the caller). Returns `first`: window w
    holds conversations first[w] to first[w + 1] - 1 (a number per window, not a table per token)."""
    first, used = [0], 0
    for i, n in enumerate(lengths):
        if used and used + n > seq_len:
            first.append(i)
            used = 0
        used += int(n)
    return np.array(first + [len(lengths)], dtype=np.int64)


def sft_loader(data: list, seq_len: int, local_batch: int, dp_rank: int, dp_size: int, global_batch: int,
               seed: int = 0):
    """train_loader for supervised fine-tuning: GlobalBatchSampler and its state over windows of packed
    conversations (PackedConversations), batches of (inputs, targets, positions); a checkpoint resumes it exactly.
    `data` names SFT token files as --data names shards (`sources`: files, comma lists, globs; no weights)."""
    windows = PackedConversations(_sft_files(data), seq_len, "train")
    sampler = GlobalBatchSampler(len(windows), local_batch, dp_rank, dp_size, global_batch, seed)
    return _stateful_loader(windows, sampler, seed)


def sft_eval_batches(data: list, seq_len: int, local_batch: int, dp_rank: int, dp_size: int, max_windows: int):
    """eval_batches for supervised fine-tuning: the held-out conversations, packed, as (inputs, targets, positions)."""
    windows = PackedConversations(_sft_files(data), seq_len, "eval")
    return _held_out_batches(windows, local_batch, dp_rank, dp_size, max_windows)


def _sft_files(data: list) -> list[Path]:
    mixture = sources(data)
    if len(mixture) > 1:
        raise ValueError("--sft: conversations are not mixed by weight (name the files alone)")
    return list(mixture[0].files)


def check_sft(data: list, cp: int = 1, pp: int = 1) -> None:
    """What supervised fine-tuning here does not take, refused in one line (ValueError): a token file without
    conversations; context parallelism (the ring attends causally over one sequence: the packed sequences' mask is
    not built into it); a pipeline (its schedules pass one tensor between stages: the positions would have to
    travel too, not built). FSDP2, DDP, tensor parallel, checkpointing and compile take the mask as it is."""
    if cp > 1:
        raise ValueError("--sft with --cp: ring attention over packed conversations is not built (use FSDP2 or --tp)")
    if pp > 1:
        raise ValueError("--sft with --pp: the pipeline's stages do not pass the packed positions (use FSDP2 or --tp)")
    plain = [str(p) for p in _sft_files(data) if "sft" not in read_meta(p)]
    if plain:
        raise ValueError(f"{', '.join(plain)}: no conversations in it (make one with `train.py prepare --sft`)")


def prepare_sft_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`prepare --sft CHAT.jsonl ... --tokenizer FOLDER --out OUT`: main's path for conversations."""
    if not args.tokenizer:
        parser.error("--sft needs --tokenizer: the folder of the model to fine-tune (its chat template and tokens)")
    if args.doc_separator or args.shard_tokens or args.workers != 1:
        parser.error("--doc-separator, --shard-tokens and --workers are for --text; --sft writes one file")
    missing = [p for p in args.sft + [args.tokenizer] if not Path(p).exists()]
    if missing:
        parser.error(f"no such file: {', '.join(missing)}")
    try:
        tok = read_tokenizer(args.tokenizer, args.eos_token)
        out = prepare_sft([c for p in args.sft for c in read_conversations(p)], args.out, tok, args.eval_fraction)
    except ValueError as e:
        parser.error(str(e))
    meta = read_meta(out)
    sft = meta["sft"]
    print(f"wrote {out}: {meta['tokens']:,} tokens of {sft['conversations']:,} conversations written by "
          f"{sft['chat_template']} chat template, {sft['targets']:,} of them targets (the assistant turns), "
          f"the last {sft['held_out']:,} conversations held out for evaluation; {sft['left_out']} without an "
          "assistant turn left out", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="train.py prepare", description="Turn text files into a token file (or "
                                     "shards) with a held-out tail for evaluation: bytes, a Hugging Face tokenizer, "
                                     "or a BPE tokenizer trained here on the same texts.")
    parser.error = lambda message: parser.exit(2, f"{parser.prog}: error: {message}\n")   # one line, status 2
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", nargs="+", help="UTF-8 text files (read as they are tokenized)")
    source.add_argument("--sft", nargs="+", metavar="CHAT.jsonl", help='conversations, {"messages": [...]} a line: '
                        "--tokenizer's chat template writes them; the assistant turns are the targets")
    parser.add_argument("--out", required=True, help="the token file to write (and OUT.json beside it)")
    parser.add_argument("--eval-fraction", type=float, default=0.05, help="the tail held out for evaluation")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--tokenizer", help="a Hugging Face tokenizer folder (a model's download) or its "
                       "tokenizer.json; its files name its special tokens")
    which.add_argument("--train-tokenizer", type=int, metavar="VOCAB", help="train a byte-level BPE tokenizer of "
                       "this vocabulary size on the texts (needs `tokenizers`)")
    parser.add_argument("--eos-token", metavar="TOKEN", help="the token that ends a document, where --tokenizer's "
                        "files name none (or another one)")
    parser.add_argument("--doc-separator", help="cut each file into documents at this string (default: a file is "
                        "a document); with a tokenizer each document ends with its end-of-text token")
    parser.add_argument("--workers", type=int, default=1, help="processes that tokenize (the same output for any "
                        "number)")
    parser.add_argument("--shard-tokens", type=int, metavar="N", help="write shards of N tokens, OUT-00000.bin, "
                        "OUT-00001.bin, ... (OUT without its suffix), each with its metadata and held-out tail; "
                        "train.py takes them all: --data OUT-*.bin")
    args = parser.parse_args(argv)
    if not 0 < args.eval_fraction < 1:
        parser.error(f"--eval-fraction must be between 0 and 1, got {args.eval_fraction}")
    if args.sft:
        return prepare_sft_command(parser, args)
    missing = [t for t in args.text if not Path(t).is_file()]
    missing += [args.tokenizer] if args.tokenizer and not Path(args.tokenizer).exists() else []
    if missing:
        parser.error(f"no such file: {', '.join(missing)}")
    if args.eos_token and not args.tokenizer:
        parser.error("--eos-token names a token of --tokenizer: give --tokenizer")
    if args.train_tokenizer is not None and args.train_tokenizer < 257:
        parser.error(f"--train-tokenizer {args.train_tokenizer}: a byte-level BPE needs more than 256 tokens")
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    tokenizer = None
    try:
        if args.tokenizer:
            tokenizer = read_tokenizer(args.tokenizer, args.eos_token)
        elif args.train_tokenizer:
            trained = train_tokenizer(read_documents(args.text, args.doc_separator), args.train_tokenizer)
            tokenizer = dataclasses.replace(from_tokenizer(trained, EOT), eos_from="trained here")
        paths = prepare_shards(read_documents(args.text, args.doc_separator), args.out, args.shard_tokens,
                               args.eval_fraction, tokenizer, args.workers)
    except ValueError as e:         # UnicodeDecodeError, a text file that is not UTF-8, is one
        parser.error(str(e).splitlines()[0])
    metas = [read_meta(p) for p in paths]
    count, held = sum(m["tokens"] for m in metas), sum(m["tokens"] - m["eval_start"] for m in metas)
    kind = f"{metas[0]['vocab_size']:,}-token" if tokenizer else "byte"
    where = str(paths[0]) if len(paths) == 1 else f"{len(paths)} shards, {paths[0]} to {paths[-1].name}"
    print(f"wrote {where}: {count:,} {kind} tokens ({metas[0]['dtype']}), {held:,} of them held out for "
          f"evaluation (the tail of {'each shard' if len(paths) > 1 else 'the file'})", file=sys.stderr)
    if tokenizer:
        print(tokenizer.summary(), file=sys.stderr)

if __name__ == "__main__":
    main()
