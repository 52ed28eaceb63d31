"""The real data sets the notebooks train on, all on disk already: nothing is downloaded at run time.

- Digits: the 1,797 8x8 handwritten digits (the test set of UCI's "Optical Recognition of Handwritten Digits"), in
  data/digits.npz; scripts/train_ddp.py reads the same file the same way, with numpy.
- Text: the Python Language Reference topics that ship with CPython itself (`pydoc_data.topics`), about 0.8 MB
  of English technical prose; read character by character, it is enough for a small Llama to learn spelling.
See data/README.md for origin and licence.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from helpers.paths import REPO_ROOT

DIGITS = REPO_ROOT / "data" / "digits.npz"  # images (1797, 8, 8) and labels (1797,), uint8


@dataclass
class Split:
    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return len(self.y)


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> tuple[Split, Split]:
    """Digits as float32 features in [0, 1] (N x 64) and int64 labels, split into train and test."""
    import numpy as np

    with np.load(DIGITS) as saved:
        images, labels = saved["images"], saved["labels"]
    x = torch.tensor(images.reshape(len(images), -1), dtype=torch.float32) / 16.0  # pixels 0..16
    y = torch.tensor(labels, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return Split(x[train], y[train]), Split(x[test], y[test])


def digits_dataset(split: Split) -> torch.utils.data.TensorDataset:
    """A Dataset (what DistributedSampler shards) over one split."""
    return torch.utils.data.TensorDataset(split.x, split.y)


def load_text() -> str:
    """The corpus as one string: every topic of CPython's language reference, in a fixed order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


class CharTokenizer:
    """Characters to ids and back; the vocabulary is every character of the corpus, sorted."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def text_tokens() -> tuple[torch.Tensor, CharTokenizer]:
    """The whole corpus as a 1-D tensor of character ids, with its tokenizer."""
    text = load_text()
    tok = CharTokenizer(text)
    return tok.encode(text), tok


def text_batch(tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator):
    """A random batch of (input, next-character target) windows, reproducible from `generator`."""
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch_size,), generator=generator)
    x = torch.stack([tokens[s:s + seq_len] for s in starts.tolist()])
    y = torch.stack([tokens[s + 1:s + seq_len + 1] for s in starts.tolist()])
    return x, y
