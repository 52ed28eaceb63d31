# From the PyTorch distributed cookbook: the cells tagged 'script:train/data.py' in
#   notebooks/06_checkpointing_and_fault_tolerance.ipynb
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
"""Tokens on disk, windows of them, and a loader whose position is part of the checkpoint.

    python data.py --text a.txt b.txt --out tokens.bin --train-tokenizer 8192    # or: python train.py prepare ...
    python data.py --text a.txt --out tokens.bin --tokenizer Llama-3.2-1B       # a Hugging Face folder or file
    python data.py --text a.txt --out tokens.bin                                 # bytes: vocabulary 256

A token file is raw uint8, uint16 or uint32 (the smallest that holds the vocabulary), read with np.memmap (a corpus
larger than memory costs nothing to open), with `OUT.json` beside it: its dtype, vocabulary size, where the
held-out tail for evaluation begins, the end-of-text and beginning-of-sequence tokens and the tokenizer's folder
(`OUT.tokenizer/`, the tokenizer's own files, so the tokens can be turned back into text by this recipe and by
`transformers.AutoTokenizer`). Documents (each text file, or the pieces `--doc-separator` cuts it into) end with
the end-of-text token, and open with the beginning-of-sequence token where the tokenizer has one of its own (Llama's;
GPT-2's is its end-of-text token). The special tokens are the ones the tokenizer's files name
(`read_tokenizer`). Several token files made with one tokenizer are shards of one corpus: train.py takes them all.

The order of the data is a function of (seed, epoch, global batch) only: a pseudo-random permutation of the
windows per epoch, computed window by window (a Feistel network: no table of the whole permutation in memory), cut
into consecutive global micro-batches, each split among the data-parallel ranks. The sampler's state is (epoch,
windows consumed so far), counted globally, so a checkpoint resumes exactly, and at another data-parallel degree
too, as long as the global batch is unchanged.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
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
                raise ValueError(f"its {file} names {name!r} as its {role.upper()} token, which its vocabulary lacks")
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
        raise ValueError(f"the tokenizer {path}: {e}") from None


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
            raise ValueError(f"--eos-token {eos_token}: not a token of its vocabulary")
    else:
        eos_id, eos_from = _named_token(tokenizer, configs, "eos")
    if eos_id is None:
        known = [t for t in KNOWN_EOS if tokenizer.token_to_id(t) is not None]
        if not known:
            raise ValueError("it names no end-of-text token (no eos_token in tokenizer_config.json or "
                             "special_tokens_map.json, no eos_token_id in generation_config.json, none of "
                             f"{', '.join(KNOWN_EOS)} in its vocabulary): name the token that ends a document "
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


def _write_atomically(path: Path, write) -> None:
    """write(temporary path), then rename: two ranks preparing at once, or a crash, never leave a half file."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    write(partial)
    os.replace(partial, path)


def prepare(texts: list[str], out: str | Path, eval_fraction: float = 0.05, tokenizer=None) -> Path:
    """Write the tokens of the documents `texts` to `out`, `out`.json (its metadata) and, with a tokenizer (a
    folder or tokenizer.json, a `tokenizers.Tokenizer` or an HFTokenizer), its files in the folder
    `out`.tokenizer; the last `eval_fraction` of the tokens is the held-out tail. Without a tokenizer the tokens are
    the UTF-8 bytes of the documents joined by blank lines (vocabulary 256)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        tokens = np.frombuffer("\n\n".join(texts).encode("utf-8"), dtype=np.uint8)
        vocab, eot, bos, folder = 256, None, None, None
    else:
        if not isinstance(tokenizer, HFTokenizer):
            tokenizer = read_tokenizer(tokenizer) if isinstance(tokenizer, (str, Path)) else from_tokenizer(tokenizer)
        eot, vocab = tokenizer.eos_id, tokenizer.tokenizer.get_vocab_size()
        bos = tokenizer.bos_id
        dtype = np.uint16 if vocab <= 2 ** 16 else np.uint32
        tokens = np.concatenate([np.array(tokenizer.document(e.ids), dtype=dtype)
                                 for e in tokenizer.tokenizer.encode_batch(texts)])
        folder = out.with_name(out.name + ".tokenizer")
        save_tokenizer(tokenizer, folder)
    if len(tokens) < 2:
        raise ValueError("the text is empty")
    meta = {"dtype": tokens.dtype.name, "vocab_size": vocab, "tokens": int(len(tokens)),
            "eval_start": int(len(tokens) * (1 - eval_fraction)), "eot_id": eot, "bos_id": bos,
            "tokenizer": folder.name if folder else None}
    _write_atomically(out, tokens.tofile)
    _write_atomically(meta_path(out), lambda p: p.write_text(json.dumps(meta)))
    return out


def meta_path(tokens_file: str | Path) -> Path:
    return Path(str(tokens_file) + ".json")


def read_meta(path: str | Path) -> dict:
    return json.loads(meta_path(path).read_text())


def vocab_size(paths: list) -> int:
    """The vocabulary of token files made with one tokenizer; ValueError if they were not."""
    metas = [read_meta(p) for p in paths]
    if len({(m["vocab_size"], m.get("eot_id")) for m in metas}) > 1:
        raise ValueError(f"the token files {[str(p) for p in paths]} were made with different tokenizers")
    return metas[0]["vocab_size"]


def describe(paths: list) -> dict:
    """What a checkpoint records of its data: the files, and the tokenizer (its folder, `read_tokenizer` reads it;
    an older token file's tokenizer.json) and end-of-text token that turn its ids back into text."""
    first = Path(paths[0])
    tokenizer = read_meta(first).get("tokenizer")
    return {"files": [str(Path(p).resolve()) for p in paths],
            "tokenizer": str((first.parent / tokenizer).resolve()) if tokenizer else None,
            "vocab_size": vocab_size(paths), "eot_id": read_meta(first).get("eot_id")}


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
        counts = [(len(t) - 1) // seq_len for t in shards]
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


def train_loader(paths: list, seq_len: int, local_batch: int, dp_rank: int, dp_size: int, global_batch: int,
                 seed: int = 0):
    """torchdata's StatefulDataLoader over the training windows of the token files `paths`: `next(iter(loader))`
    is this rank's micro-batch, and `loader.state_dict()` its exact position (kept in the checkpoint). Its own
    generator: each `iter(loader)` draws a seed, which would otherwise come from the global generator and shift
    the draws of dropout after a resume."""
    import warnings

    from torchdata.stateful_dataloader import StatefulDataLoader

    windows = TokenWindows([load_tokens(p, "train") for p in paths], seq_len)
    sampler = GlobalBatchSampler(len(windows), local_batch, dp_rank, dp_size, global_batch, seed)
    with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, which newer torch deprecates
        warnings.filterwarnings("ignore", message=".*set_vital")
        return StatefulDataLoader(windows, batch_sampler=sampler, num_workers=0,
                                  generator=torch.Generator().manual_seed(seed))


def eval_batches(paths: list, seq_len: int, local_batch: int, dp_rank: int, dp_size: int, max_windows: int):
    """The held-out windows (the first `max_windows` of the tails, in order), this rank's share in batches: the
    same set at every layout, so the evaluation loss is comparable between layouts."""
    windows = TokenWindows([load_tokens(p, "eval") for p in paths], seq_len)
    n = min(len(windows), max_windows) // dp_size * dp_size
    if n == 0:
        raise ValueError(f"the held-out tail has {len(windows)} windows of {seq_len}: fewer than {dp_size} ranks")
    mine = list(range(dp_rank, n, dp_size))
    for i in range(0, len(mine), local_batch):
        items = [windows[j] for j in mine[i:i + local_batch]]
        yield torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="train.py prepare", description="Turn text files into a token file with "
                                     "a held-out tail for evaluation: bytes, a tokenizer.json, or a BPE tokenizer "
                                     "trained here on the same texts.")
    parser.error = lambda message: parser.exit(2, f"{parser.prog}: error: {message}\n")   # one line, status 2
    parser.add_argument("--text", nargs="+", required=True, help="UTF-8 text files")
    parser.add_argument("--out", required=True, help="the token file to write (and OUT.json beside it)")
    parser.add_argument("--eval-fraction", type=float, default=0.05, help="the tail held out for evaluation")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--tokenizer", help="a Hugging Face tokenizer folder (a model's download) or its "
                       "tokenizer.json; its files name its special tokens")
    which.add_argument("--train-tokenizer", type=int, metavar="VOCAB", help="train a byte-level BPE tokenizer of "
                       "this vocabulary size on the texts (needs `tokenizers`)")
    parser.add_argument("--doc-separator", help="cut each file into documents at this string (default: a file is "
                        "a document); with a tokenizer each document ends with its end-of-text token")
    parser.add_argument("--eos-token", metavar="TOKEN", help="the token that ends a document, where --tokenizer's "
                        "files name none (or another one)")
    args = parser.parse_args(argv)
    if not 0 < args.eval_fraction < 1:
        parser.error(f"--eval-fraction must be between 0 and 1, got {args.eval_fraction}")
    missing = [t for t in args.text if not Path(t).is_file()]
    missing += [args.tokenizer] if args.tokenizer and not Path(args.tokenizer).exists() else []
    if missing:
        parser.error(f"no such file: {', '.join(missing)}")
    if args.eos_token and not args.tokenizer:
        parser.error("--eos-token names a token of --tokenizer: give --tokenizer")
    if args.train_tokenizer is not None and args.train_tokenizer < 257:
        parser.error(f"--train-tokenizer {args.train_tokenizer}: a byte-level BPE needs more than 256 tokens")
    texts = [Path(t).read_text(encoding="utf-8") for t in args.text]
    if args.doc_separator:
        texts = [doc for text in texts for doc in text.split(args.doc_separator) if doc.strip()]
    tokenizer = None
    try:
        if args.tokenizer:
            tokenizer = read_tokenizer(args.tokenizer, args.eos_token)
        elif args.train_tokenizer:
            tokenizer = from_tokenizer(train_tokenizer(texts, args.train_tokenizer), EOT)
            tokenizer.eos_from = "trained here"
        out = prepare(texts, args.out, args.eval_fraction, tokenizer)
    except ValueError as e:
        parser.error(str(e))
    if tokenizer:
        print(tokenizer.summary(), file=sys.stderr)
    meta = read_meta(out)
    kind = f"{meta['vocab_size']:,}-token BPE" if tokenizer else "byte"
    print(f"wrote {out}: {meta['tokens']:,} {kind} tokens ({meta['dtype']}) from {len(texts)} document"
          f"{'s' * (len(texts) != 1)}, the last {meta['tokens'] - meta['eval_start']:,} held out for evaluation",
          file=sys.stderr)

if __name__ == "__main__":
    main()
