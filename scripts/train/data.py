# From the PyTorch distributed cookbook: the cells tagged 'script:train/data.py' in
#   notebooks/06_checkpointing_and_fault_tolerance.ipynb
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
"""Tokens on disk, windows of them, and a loader whose position is part of the checkpoint.

    python data.py --text a.txt b.txt --out tokens.bin          # or: python train.py prepare --text ... --out ...

Byte-level tokens (vocabulary 256, nothing to download or train): a text file's UTF-8 bytes are its tokens. The
token file is raw uint8 (read with np.memmap, so a corpus larger than memory costs nothing to open) with a
`.json` beside it saying its dtype and where the held-out tail for evaluation begins.

The order of the data is a function of (seed, epoch, global batch) only: one permutation of the windows per epoch,
cut into consecutive global micro-batches, each split among the data-parallel ranks. The sampler's state is
(epoch, windows consumed so far), counted globally, so a checkpoint resumes exactly, and at another data-parallel
degree too, as long as the global batch is unchanged.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

DTYPES = {"uint8": np.uint8, "uint16": np.uint16}


def default_corpus_text() -> str:
    """CPython's language reference, shipped with Python (pydoc_data.topics, about 0.8 MB): what the notebooks
    train on."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def prepare(texts: list[str], out: str | Path, eval_fraction: float = 0.05) -> Path:
    """Write the UTF-8 bytes of `texts` (strings) to `out` as uint8 tokens and `out`.json with its metadata; the
    last `eval_fraction` of the tokens is the held-out tail. Written to a temporary name, then renamed: two ranks
    preparing at once, or a crash, never leave a half file under the final name."""
    import os

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokens = np.frombuffer("\n\n".join(texts).encode("utf-8"), dtype=np.uint8)
    if len(tokens) < 2:
        raise ValueError("the text is empty")
    meta = {"dtype": "uint8", "vocab_size": 256, "tokens": int(len(tokens)),
            "eval_start": int(len(tokens) * (1 - eval_fraction))}
    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
    tokens.tofile(partial)
    os.replace(partial, out)
    partial_meta = out.with_name(f".{out.name}.json.{os.getpid()}.partial")
    partial_meta.write_text(json.dumps(meta))
    os.replace(partial_meta, meta_path(out))
    return out


def meta_path(tokens_file: str | Path) -> Path:
    return Path(str(tokens_file) + ".json")


def load_tokens(path: str | Path, split: str) -> np.ndarray:
    """The train or eval part of a token file, memory-mapped (read-only, nothing loaded yet)."""
    meta = json.loads(meta_path(path).read_text())
    tokens = np.memmap(path, dtype=DTYPES[meta["dtype"]], mode="r", shape=(meta["tokens"],))
    return tokens[:meta["eval_start"]] if split == "train" else tokens[meta["eval_start"]:]


class TokenWindows(torch.utils.data.Dataset):
    """Non-overlapping windows of seq_len tokens and their next tokens: item i is (x, y), y = x shifted by one."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        self.n = (len(tokens) - 1) // seq_len
        if self.n < 1:
            raise ValueError(f"{len(tokens)} tokens make no window of {seq_len}")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        chunk = torch.from_numpy(self.tokens[i * self.seq_len:(i + 1) * self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


class GlobalBatchSampler:
    """An endless, stateful batch sampler: yields this data-parallel rank's share (`local` window indices) of each
    global micro-batch (`local * dp_size` consecutive windows of the epoch's permutation). Its state counts windows
    globally, so it is the same on every rank and at every data-parallel degree. StatefulDataLoader saves it (it
    is its own iterator, with state_dict/load_state_dict)."""

    def __init__(self, n_windows: int, local: int, dp_rank: int, dp_size: int, global_batch: int, seed: int = 0):
        self.n, self.local, self.dp_rank, self.dp_size, self.seed = n_windows, local, dp_rank, dp_size, seed
        self.per_epoch = n_windows // global_batch * global_batch   # whole optimizer steps only
        if self.per_epoch == 0:
            raise ValueError(f"{n_windows} training windows make no global batch of {global_batch}")
        self.epoch, self.consumed, self._perm_epoch, self._perm = 0, 0, None, None

    def _permutation(self) -> torch.Tensor:
        if self._perm_epoch != self.epoch:
            generator = torch.Generator().manual_seed(self.seed * 7919 + self.epoch)
            self._perm, self._perm_epoch = torch.randperm(self.n, generator=generator), self.epoch
        return self._perm

    def __iter__(self):
        return self

    def __next__(self) -> list[int]:
        if self.consumed >= self.per_epoch:
            self.epoch, self.consumed = self.epoch + 1, 0
        start = self.consumed + self.dp_rank * self.local
        self.consumed += self.local * self.dp_size
        return self._permutation()[start:start + self.local].tolist()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])


def train_loader(path: str | Path, seq_len: int, local_batch: int, dp_rank: int, dp_size: int, global_batch: int,
                 seed: int = 0):
    """torchdata's StatefulDataLoader over the training windows: `next(iter(loader))` is this rank's micro-batch,
    and `loader.state_dict()` its exact position (kept in the checkpoint)."""
    import warnings

    from torchdata.stateful_dataloader import StatefulDataLoader

    windows = TokenWindows(load_tokens(path, "train"), seq_len)
    sampler = GlobalBatchSampler(len(windows), local_batch, dp_rank, dp_size, global_batch, seed)
    with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, which newer torch deprecates
        warnings.filterwarnings("ignore", message=".*set_vital")
        return StatefulDataLoader(windows, batch_sampler=sampler, num_workers=0)


def eval_batches(path: str | Path, seq_len: int, local_batch: int, dp_rank: int, dp_size: int, max_windows: int):
    """The held-out windows (the first `max_windows` of the tail, in order), this rank's share in batches: the
    same set at every layout, so the evaluation loss is comparable between layouts."""
    windows = TokenWindows(load_tokens(path, "eval"), seq_len)
    n = min(len(windows), max_windows) // dp_size * dp_size
    if n == 0:
        raise ValueError(f"the held-out tail has {len(windows)} windows of {seq_len}: fewer than {dp_size} ranks")
    mine = list(range(dp_rank, n, dp_size))
    for i in range(0, len(mine), local_batch):
        items = [windows[j] for j in mine[i:i + local_batch]]
        yield torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Turn text files into a byte-level token file (uint8) with a "
                                     "held-out tail for evaluation.")
    parser.add_argument("--text", nargs="+", required=True, help="UTF-8 text files")
    parser.add_argument("--out", required=True, help="the token file to write (and OUT.json beside it)")
    parser.add_argument("--eval-fraction", type=float, default=0.05, help="the tail held out for evaluation")
    args = parser.parse_args(argv)
    if not 0 < args.eval_fraction < 1:
        parser.error(f"--eval-fraction must be between 0 and 1, got {args.eval_fraction}")
    missing = [t for t in args.text if not Path(t).is_file()]
    if missing:
        parser.error(f"no such file: {', '.join(missing)}")
    out = prepare([Path(t).read_text(encoding="utf-8") for t in args.text], args.out, args.eval_fraction)
    meta = json.loads(meta_path(out).read_text())
    print(f"wrote {out}: {meta['tokens']:,} byte tokens, the last {meta['tokens'] - meta['eval_start']:,} held out "
          f"for evaluation", file=sys.stderr)

if __name__ == "__main__":
    main()
