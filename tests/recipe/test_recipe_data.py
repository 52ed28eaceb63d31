"""scripts/train/data.py's pieces, in one process: the shuffle that holds no table (a bijection, computed window by
window), the sampler's exact resume at another data-parallel degree, windows over several token files (shards) that
never cross from one file to the next, documents ended by the tokenizer's end-of-text token, and the vocabulary that
token files made with different tokenizers do not share."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

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


# ------------------------------------------------------------------------------------------ prepare at scale
SEPARATOR = "\n@@\n"


def _paragraphs() -> list[str]:
    """Documents of real text, each at most a few kilobytes: the language reference's paragraphs."""
    from pydoc_data.topics import topics

    return [p for key in sorted(topics) for p in topics[key].split("\n\n") if p.strip()]


def _corpus_file(path, chars: int):
    """A text file of `chars` characters or a little more: the paragraphs, over and over, cut by SEPARATOR."""
    paragraphs, written = _paragraphs(), 0
    with open(path, "w", encoding="utf-8") as f:
        while written < chars:
            doc = paragraphs[written % len(paragraphs)] + SEPARATOR
            written += f.write(doc)
    return path


@pytest.fixture(scope="module")
def bpe():
    pytest.importorskip("tokenizers")
    return data.train_tokenizer(_paragraphs()[:2000], vocab_size=400)


def test_read_documents_cuts_at_the_separator_across_chunk_boundaries(tmp_path):
    docs = [f"document {i} " + "x" * (i * 7 % 23) for i in range(40)] + ["  \n  "]    # a blank piece is dropped
    path = tmp_path / "t.txt"
    path.write_text(SEPARATOR.join(docs), encoding="utf-8")
    for chunk in (1, 3, 5, 64, 1 << 20):     # separators cut by every chunk boundary there is
        assert list(data.read_documents([path], SEPARATOR, chunk)) == docs[:-1], chunk
    assert list(data.read_documents([path, path])) == [path.read_text()] * 2, "without a separator: a file each"


def test_prepare_holds_memory_bounded_by_its_batches_not_by_the_corpus(tmp_path, bpe):
    """tracemalloc's peak in the preparing process, over a corpus 4x the bound: the old prepare, which read the
    whole text, held more than the corpus. Measured here: about 0.3 MiB (documents of at most 6 kB, batches of
    16 kB), against the bound of 1 MiB."""
    import tracemalloc

    bound = 1 << 20
    corpus = _corpus_file(tmp_path / "corpus.txt", 4 * bound)
    tracemalloc.start()
    try:
        shards = data.prepare_shards(data.read_documents([corpus], SEPARATOR, 1 << 14), tmp_path / "t.bin",
                                     shard_tokens=200_000, tokenizer=bpe, batch_chars=1 << 14)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < bound < corpus.stat().st_size / 4, f"peak {peak / 2**20:.2f} MiB"
    tokens = sum(data.read_meta(p)["tokens"] for p in shards)
    assert len(shards) == -(-tokens // 200_000) > 2, "the whole corpus, in shards"


def test_shards_hold_the_single_files_tokens_each_with_its_held_out_tail(tmp_path, bpe):
    """(Several workers writing the same files: tests/recipe/test_recipe_tokenizer.py, through train.py prepare.)"""
    corpus = _corpus_file(tmp_path / "corpus.txt", 200_000)
    single = data.prepare(data.read_documents([corpus], SEPARATOR), tmp_path / "one.bin", 0.1, bpe)
    shards = data.prepare_shards(data.read_documents([corpus], SEPARATOR, 4096), tmp_path / "s.bin", 10_000, 0.1,
                                 bpe, batch_chars=4096)
    assert [p.name for p in shards] == [f"s-{i:05d}.bin" for i in range(len(shards))] and len(shards) > 3
    counts = [data.read_meta(p)["tokens"] for p in shards]
    assert set(counts[:-1]) == {10_000} and 0 < counts[-1] <= 10_000
    assert b"".join(p.read_bytes() for p in shards) == single.read_bytes(), "cut where the single file's tokens are"
    assert all(0 < data.read_meta(p)["eval_start"] < data.read_meta(p)["tokens"] for p in shards[:-1]), \
        "every shard holds out its own tail"
    assert data.describe(shards)["tokenizer"] == str((tmp_path / "s.bin.tokenizer").resolve()), "one folder for all"
    fewer = data.prepare_shards(["a short text"] * 3, tmp_path / "s.bin", 10_000, 0.1, bpe)
    assert sorted(tmp_path.glob("s-*.bin")) == fewer, "an earlier prepare's shards past the new last one are gone"


# ------------------------------------------------------------------------------------------ several sources
def test_sources_reads_shards_of_one_corpus_or_sources_with_weights(tmp_path):
    a = [_token_file(tmp_path, f"a-{i:05d}.bin", range(30), 20) for i in range(3)]
    b = _token_file(tmp_path, "b.bin", range(30), 20)
    assert data.sources([a[0], a[1], b]) == [data.Source((a[0], a[1], b), 1.0)], "token files alone: one corpus"
    mixed = data.sources([f"{tmp_path}/a-*.bin:3", f"{b},{a[0]}:1"])
    assert mixed == [data.Source(tuple(a), 0.75), data.Source((b, a[0]), 0.25)]
    for bad, says in (([f"{b}:0.5", str(a[0])], "every source a weight"), ([f"{b}:-1"], "positive"),
                      ([f"{tmp_path}/c-*.bin:1"], "no such token file"), ([f"{tmp_path}/nope.bin"], "nope.bin")):
        with pytest.raises(ValueError, match=says):
            data.sources(bad)


def _mixture_batches(sizes, weights, local, dp, steps, state=None):
    samplers = [data.MixtureSampler(sizes, weights, local, r, dp, seed=5) for r in range(dp)]
    if state is not None:
        for s in samplers:
            s.load_state_dict(json.loads(json.dumps(state)))       # through JSON, as the checkpoint keeps it
    return [[i for s in samplers for i in next(s)] for _ in range(steps)], samplers[0].state_dict()


def test_a_mixture_draws_each_share_exactly_and_resumes_at_another_data_parallel_degree():
    sizes, weights = [500, 40, 7], [0.6, 0.3, 0.1]
    whole, _ = _mixture_batches(sizes, weights, 12, 1, 50)
    first, state = _mixture_batches(sizes, weights, 6, 2, 21)                   # 2 ranks, stopped after 21 steps
    rest, _ = _mixture_batches(sizes, weights, 3, 4, 29, state=state)          # resumed on 4 ranks
    assert first + rest == whole, "the same stream, whoever draws it"
    stream = np.array([i for batch in whole for i in batch])
    source = np.searchsorted(np.cumsum(sizes), stream, side="right")
    for s, w in enumerate(weights):
        drawn = np.cumsum(source == s)
        assert np.abs(drawn - w * np.arange(1, len(stream) + 1)).max() < 1, "every prefix holds each share"
    small = stream[source == 2] - (500 + 40)                     # 60 draws of 7 windows: 8 whole epochs and 4
    epochs = [small[k:k + 7] for k in range(0, 56, 7)]
    assert all(sorted(e) == list(range(7)) for e in epochs) and len({tuple(e) for e in epochs}) > 1, \
        "each epoch of a source is a permutation of its windows, another order each epoch"


def test_the_loader_mixes_token_files_and_resumes_exactly(tmp_path):
    a = _token_file(tmp_path, "a.bin", range(0, 400), 360)          # 45 windows of 8
    b = _token_file(tmp_path, "b.bin", range(1000, 1100), 90)       # 11 windows
    spec = [f"{a}:0.8", f"{b}:0.2"]
    loader = data.train_loader(spec, 8, 10, 0, 1, 10, seed=1)
    batches = iter(loader)
    seen = [next(batches)[0] for _ in range(5)]
    from_b = sum(int((x >= 1000).all()) for batch in seen for x in batch)
    assert from_b == 10, "a fifth of 50 windows from b"
    state = json.loads(json.dumps(loader.state_dict()))
    resumed = data.train_loader(spec, 8, 5, 1, 2, 10, seed=1)       # rank 1 of 2
    resumed.load_state_dict(state)
    upcoming = next(batches)[0]
    assert torch.equal(next(iter(resumed))[0], upcoming[5:]), "the resumed rank 1 gets its half of batch 6"
    one_corpus = data.train_loader([a, b], 8, 10, 0, 1, 10, seed=1)      # --data a b: shards of one corpus
    assert isinstance(one_corpus.batch_sampler, data.GlobalBatchSampler)


def test_evaluation_windows_come_from_every_shard(tmp_path):
    shards = [_token_file(tmp_path, f"s{k}.bin", range(1000 * k, 1000 * k + 100), 20) for k in range(3)]
    seen = [x for x, _ in data.eval_batches(shards, seq_len=8, local_batch=2, dp_rank=0, dp_size=1, max_windows=6)]
    firsts = sorted(int(x[0]) for batch in seen for x in batch)
    assert [f // 1000 for f in firsts] == [0, 0, 1, 1, 2, 2], "two windows of each shard's tail, not six of the first"
    ranks = [[int(row[0]) for xs, _ in data.eval_batches(shards, 8, 2, r, 2, 6) for row in xs] for r in range(2)]
    assert sorted(ranks[0] + ranks[1]) == firsts, "the same set at another data-parallel degree"


def test_the_fingerprint_says_what_a_resume_would_find_changed(tmp_path):
    a = _token_file(tmp_path, "a.bin", range(100), 80)
    b = _token_file(tmp_path, "b.bin", range(100), 80)
    saved = data.fingerprint([f"{a}:0.7", f"{b}:0.3"], seq_len=8, seed=1)
    moved = tmp_path / "moved"
    moved.mkdir()
    for p in (a, b):
        for f in (p, data.meta_path(p)):
            (moved / f.name).write_bytes(f.read_bytes())
    assert data.fingerprint_change(saved, data.fingerprint([f"{moved}/a.bin:7", f"{moved}/b.bin:3"], 8, 1)) is None, \
        "the same files elsewhere, the same weights spelled otherwise"
    changes = {"--seq-len was 8, now 16": data.fingerprint([f"{a}:0.7", f"{b}:0.3"], 16, 1),
               "--seed was 1, now 2": data.fingerprint([f"{a}:0.7", f"{b}:0.3"], 8, 2),
               "were 0.7, 0.3, now 0.5, 0.5": data.fingerprint([f"{a}:1", f"{b}:1"], 8, 1),
               "gone: b.bin; new: c.bin": data.fingerprint(
                   [f"{a}:0.7", f"{_token_file(tmp_path, 'c.bin', range(100), 80)}:0.3"], 8, 1)}
    for says, now in changes.items():
        line = data.fingerprint_change(saved, now)
        assert says in line and "\n" not in line, line
    _token_file(tmp_path, "b.bin", range(100), 90)                      # b re-prepared: another held-out split
    assert "b.bin changed" in data.fingerprint_change(saved, data.fingerprint([f"{a}:0.7", f"{b}:0.3"], 8, 1))
