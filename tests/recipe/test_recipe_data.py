"""scripts/train/data.py's pieces, in one process: the shuffle that holds no table (a bijection, computed window by
window), the sampler's exact resume at another data-parallel degree, windows over several token files (shards) that
never cross from one file to the next, documents ended by the tokenizer's end-of-text token, and the vocabulary that
token files made with different tokenizers do not share."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from helpers.paths import SCRIPTS

sys.path.insert(0, str(SCRIPTS / "train"))
import data  # noqa: E402


@pytest.mark.parametrize("n", [1, 2, 3, 7, 1000, 4097, 65537])
def test_the_shuffle_is_a_bijection_of_the_windows(n):
    for key in (0, 1, 12345):
        assert sorted(data.permute(np.arange(n), n, key).tolist()) == list(range(n))


def test_the_shuffle_depends_on_the_key_and_looks_random():
    n = 10_000
    a, b = data.permute(np.arange(n), n, 1), data.permute(np.arange(n), n, 2)
    assert (a != b).mean() > 0.99, "another epoch (key), another order"
    steps = np.abs(np.diff(a))
    assert np.median(steps) > n / 10, "neighbouring positions land far apart: no stride or block pattern"
    # computed for some positions alone, the same as within the whole permutation
    picked = np.array([0, 17, 9_999, 5_000])
    assert data.permute(picked, n, 1).tolist() == a[picked].tolist()


def _global_batches(n, local, dp, global_batch, steps, state=None):
    samplers = [data.GlobalBatchSampler(n, local, r, dp, global_batch, seed=3) for r in range(dp)]
    if state is not None:
        for s in samplers:
            s.load_state_dict(state)
    batches = [[i for s in samplers for i in next(s)] for _ in range(steps)]
    return batches, samplers[0].state_dict()


def test_the_sampler_resumes_exactly_at_another_data_parallel_degree_and_across_epochs():
    n, global_batch = 103, 8                   # 12 whole steps per epoch, 7 windows left out of each
    whole, _ = _global_batches(n, 8, 1, global_batch, 30)
    first, state = _global_batches(n, 4, 2, global_batch, 17)                 # 2 ranks, killed after 17 steps
    rest, _ = _global_batches(n, 2, 4, global_batch, 13, state=state)         # resumed on 4 ranks
    assert first + rest == whole, "the same global batches, whoever draws them"
    epoch0 = [i for batch in whole[:12] for i in batch]
    assert len(set(epoch0)) == 96 and state == {"epoch": 1, "consumed": 40}, "no window twice in an epoch"


def _token_file(tmp_path, name, tokens, eval_start, vocab=300, eot=0):
    path = tmp_path / name
    np.asarray(tokens, dtype=np.uint16).tofile(path)
    data.meta_path(path).write_text(f'{{"dtype": "uint16", "vocab_size": {vocab}, "tokens": {len(tokens)}, '
                                    f'"eval_start": {eval_start}, "eot_id": {eot}, "tokenizer": null}}')
    return path


def test_windows_over_shards_never_cross_from_one_file_to_the_next(tmp_path):
    a = _token_file(tmp_path, "a.bin", range(0, 50), 40)       # train part: 40 tokens, 4 windows of 8 (+1 target)
    b = _token_file(tmp_path, "b.bin", range(100, 130), 20)    # train part: 20 tokens, 2 windows
    windows = data.TokenWindows([data.load_tokens(p, "train") for p in (a, b)], seq_len=8)
    assert len(windows) == 4 + 2
    for i in range(len(windows)):
        x, y = windows[i]
        assert (x.max() < 50) == (y.max() < 50) == (i < 4), "a window and its targets come from one file"
        assert y.tolist() == [v + 1 for v in x.tolist()]
    assert data.vocab_size([a, b]) == 300
    other = _token_file(tmp_path, "c.bin", range(20), 10, vocab=512)
    with pytest.raises(ValueError, match="different tokenizers"):
        data.vocab_size([a, other])


def test_prepare_ends_every_document_with_the_end_of_text_token(tmp_path):
    pytest.importorskip("tokenizers")
    docs = ["first document, with words", "the second one", "a third"]
    tokenizer = data.train_tokenizer(docs * 20, vocab_size=300)
    out = data.prepare(docs, tmp_path / "t.bin", eval_fraction=0.2, tokenizer=tokenizer)
    meta = data.read_meta(out)
    tokens = np.fromfile(out, dtype=np.uint16).tolist()
    eot = meta["eot_id"]
    ends = [i for i, t in enumerate(tokens) if t == eot]
    assert len(ends) == 3 and ends[-1] == len(tokens) - 1
    pieces = [tokens[a + 1:b] for a, b in zip([-1] + ends, ends)]
    assert [tokenizer.decode(p) for p in pieces] == docs
    assert (tmp_path / meta["tokenizer"] / "tokenizer.json").is_file()
    assert meta["vocab_size"] == tokenizer.get_vocab_size()
