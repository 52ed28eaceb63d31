"""Supervised fine-tuning in the recipe. The model (scripts/train/model.py, notebook 03): conversations packed into
one row (`positions`, a block-causal mask) give each conversation's own loss and gradients, in one process, under
tensor parallel and under FSDP2. The data (scripts/train/data.py, notebook 06), with the folders users download
(tests/recipe/user_folders.py): a conversation rendered by the tokenizer's chat template as transformers'
`apply_chat_template` renders it (the same ids); its targets exactly the assistant turns and their end-of-turn token,
with Llama 3's template and with the default one; `train.py prepare --sft`; windows of whole conversations, packed,
truncated where too long, whose loss is each conversation's own; a loader that resumes exactly and splits alike at
another data-parallel degree; what is refused, in one line."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers.launcher import launch
from helpers.paths import SCRIPTS

sys.path.insert(0, str(SCRIPTS / "train"))
import data  # noqa: E402
from config import LlamaArgs  # noqa: E402
from model import IGNORE_INDEX, Llama, cross_entropy  # noqa: E402

CFG = LlamaArgs(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=48, multiple_of=32)
LENGTHS = (13, 9, 20)          # three conversations, then 6 tokens of padding: a row of 48


def packed_row(lengths=LENGTHS, seq=CFG.max_seq_len, seed=0):
    """Conversations of `lengths` tokens packed into one row of `seq`, as the SFT loader makes them: (tokens,
    targets, positions, each conversation's (tokens, targets)). A conversation's targets are its next tokens where
    they are answers (here a random two thirds), -100 elsewhere and at its last token; padding has none."""
    g = torch.Generator().manual_seed(seed)
    alone, pieces = [], []
    for n in lengths:
        tokens = torch.randint(0, CFG.vocab_size, (n,), generator=g)
        targets = torch.cat([tokens[1:], torch.tensor([IGNORE_INDEX])])
        targets[torch.rand(n, generator=g) < 1 / 3] = IGNORE_INDEX
        alone.append((tokens, targets))
        pieces.append((tokens, targets, torch.arange(n)))
    pad = seq - sum(lengths)
    pieces.append((torch.zeros(pad, dtype=torch.long), torch.full((pad,), IGNORE_INDEX), torch.arange(pad)))
    tokens, targets, positions = (torch.cat(parts)[None] for parts in zip(*pieces))
    return tokens, targets, positions, alone


def _model(seed=7):
    model = Llama(CFG)
    model.init_weights(seed)
    with torch.no_grad():           # sharper attention than at initialisation: where a leak across rows would show
        for name, p in model.named_parameters():
            p.mul_(10 if name.endswith(("wq.weight", "wk.weight")) else 1)
    return model


def _loss_and_grads(model, loss):
    model.zero_grad()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_packed_row_gives_each_conversations_own_loss_and_gradients():
    """float32. Packed: the mean over the row's targets. Alone: each conversation's summed loss, added, divided by
    the same count of targets. Tolerance 1e-5 relative (1e-7 absolute): the same sums, the masked scores exactly zero,
    in another order. Without the mask, or with positions running on across the row, they differ by far more."""
    model = _model()
    tokens, targets, positions, alone = packed_row()
    count = int((targets != IGNORE_INDEX).sum())
    packed = _loss_and_grads(model, cross_entropy(model(tokens, positions=positions), targets))
    total = sum(cross_entropy(model(t[None]), y[None], reduction="sum") for t, y in alone)
    one_by_one = _loss_and_grads(model, total / count)
    assert abs(packed[0] - one_by_one[0]) <= 1e-5 * one_by_one[0]
    for name, grad in one_by_one[1].items():
        torch.testing.assert_close(packed[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)
    running = torch.arange(tokens.shape[1])[None]          # positions that do not restart: one long sequence
    for wrong in (cross_entropy(model(tokens), targets), cross_entropy(model(tokens, positions=running), targets)):
        assert abs(wrong.item() - one_by_one[0]) > 1e-3, "attention across conversations changes the loss"


def test_a_mask_that_restarts_is_block_causal_and_the_cache_path_is_unchanged():
    from model import block_causal_mask

    mask = block_causal_mask(torch.tensor([[0, 1, 2, 0, 1, 0]]))[0, 0]
    expected = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                             [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)
    model = _model().eval()
    tokens = packed_row()[0][:, :20]
    with torch.no_grad():
        whole = model(tokens, positions=torch.arange(20)[None])      # one sequence from 0: the plain causal model
        assert torch.allclose(whole, model(tokens), atol=1e-6)


def _parallel_packed(layout, lengths):
    """The packed row through the model on 2 ranks, tensor parallel (sequence parallel, loss_parallel) or FSDP2
    (each rank the same row), against one process: loss and the gradients (full tensors)."""
    import sys

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    sys.path.insert(0, str(SCRIPTS / "train"))
    from model import cross_entropy
    from parallelize import apply_fsdp
    from tp import apply_tp

    dist.init_process_group("gloo")
    try:
        tokens, targets, positions, _ = packed_row(lengths)
        reference, model = _model(), _model()
        ref_loss, ref_grads = _loss_and_grads(reference, cross_entropy(reference(tokens, positions=positions), targets))
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        if layout == "tp":
            apply_tp(model, mesh, loss_parallel=True)
        else:
            apply_fsdp(model, mesh)
        with loss_parallel() if layout == "tp" else torch.enable_grad():
            loss = cross_entropy(model(tokens, positions=positions), targets)
            loss.backward()
        full = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        gaps = {n: (p.grad.full_tensor() - ref_grads[n]).abs().max().item() for n, p in model.named_parameters()}
        return {"loss_gap": abs(full.item() - ref_loss), "grad_gap": max(gaps.values())}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", ["tp", "fsdp"])
def test_under_tensor_parallel_and_fsdp2_the_packed_row_is_one_process(layout):
    for r in launch(_parallel_packed, layout, LENGTHS, world_size=2, timeout=180):
        assert r["loss_gap"] < 1e-5 and r["grad_gap"] < 1e-5, r


# ----------------------------------------------------------------------------------------------------------- data
def _conversations(downloads):
    return data.read_conversations(downloads.chat)


def _jinja_layout(folder, tmp_path):
    """The folder as transformers 5 writes it: the chat template in chat_template.jinja, not tokenizer_config.json."""
    copy = shutil.copytree(folder, tmp_path / "jinja_layout")
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "chat_template.jinja").write_text(config.pop("chat_template"))
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.parametrize("layout", ["hub", "transformers5"])
def test_the_chat_template_renders_the_ids_of_transformers_apply_chat_template(downloads, tmp_path, layout):
    from transformers import AutoTokenizer

    folder = downloads.llama3 if layout == "hub" else _jinja_layout(downloads.llama3, tmp_path)
    ours, theirs = data.read_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert ours.chat_template
    for messages in _conversations(downloads):
        ids, _ = data.conversation_tokens(ours, messages)
        for prompt, mine in ((False, ids), (True, ours.tokenizer.encode(data.render_chat(ours, messages[:2], True),
                                                                         add_special_tokens=False).ids)):
            reference = theirs.apply_chat_template(messages if not prompt else messages[:2], tokenize=True,
                                                   add_generation_prompt=prompt)
            assert mine == list(reference["input_ids"] if hasattr(reference, "keys") else reference)


@pytest.mark.parametrize("name, end", [("llama3", "<|eot_id|>"), ("llama2", "</s>"), ("gpt2", "<|endoftext|>")])
def test_the_targets_are_the_assistant_turns_and_their_end_of_turn_token(downloads, name, end):
    """Llama 3's template, and the default one (Llama 2 and GPT-2 have none): each run of targets decodes to an
    assistant's message and the token that ends its turn; nothing else is a target."""
    tok = data.read_tokenizer(getattr(downloads, name))
    assert (tok.chat_template is not None) == (name == "llama3")
    for messages in _conversations(downloads):
        ids, targets = data.conversation_tokens(tok, messages)
        runs, run = [], []
        for i, is_target in zip(ids, targets):
            if is_target:
                run.append(i)
            elif run:
                runs, run = runs + [run], []
        runs += [run] if run else []
        answers = [m["content"].strip() + end for m in messages if m["role"] == "assistant"]
        assert [tok.tokenizer.decode(r, skip_special_tokens=False).strip() for r in runs] == answers


def test_a_template_that_rewrites_earlier_turns_is_refused(downloads):
    tok = data.read_tokenizer(downloads.llama3)
    tok.chat_template = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="prefix by prefix"):
        data.conversation_tokens(tok, _conversations(downloads)[0])


@pytest.fixture(scope="module")
def sft_file(downloads, tmp_path_factory):
    """`train.py prepare --sft` from a copy of the recipe: the chat file with the Llama 3.2 folder."""
    root = tmp_path_factory.mktemp("sft")
    for source in (SCRIPTS / "train").glob("*.py"):
        shutil.copy(source, root / source.name)
    done = subprocess.run([sys.executable, "train.py", "prepare", "--sft", str(downloads.chat), "--tokenizer",
                           str(downloads.llama3), "--out", "sft.bin"], cwd=root, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "24 conversations written by its own chat template" in done.stderr, done.stderr
    return root / "sft.bin"


def test_prepare_sft_writes_tokens_targets_and_conversation_starts(sft_file, downloads):
    tok = data.read_tokenizer(downloads.llama3)
    meta = data.read_meta(sft_file)
    tokens, targets = np.fromfile(sft_file, dtype=meta["dtype"]), np.fromfile(data.sft_file(sft_file, "targets"), np.uint8)
    starts = np.fromfile(data.sft_file(sft_file, "starts"), dtype=np.int64)
    conversations = _conversations(downloads)
    assert len(starts) == len(conversations) + 1 and starts[-1] == len(tokens) == len(targets)
    for messages, a, b in zip(conversations, starts[:-1], starts[1:]):
        ids, mask = data.conversation_tokens(tok, messages)
        assert tokens[a:b].tolist() == ids and targets[a:b].tolist() == [int(m) for m in mask]
    assert meta["sft"]["held_out"] == 1 and meta["eval_start"] == starts[-2], "the last conversation held out"
    assert data.read_tokenizer(sft_file.with_name("sft.bin.tokenizer")).chat_template == tok.chat_template


def test_windows_hold_whole_conversations_and_their_targets(sft_file):
    meta = data.read_meta(sft_file)
    tokens = np.fromfile(sft_file, dtype=meta["dtype"])
    targets = np.fromfile(data.sft_file(sft_file, "targets"), np.uint8)
    starts = np.fromfile(data.sft_file(sft_file, "starts"), dtype=np.int64)[:-1]      # the training conversations
    windows = data.PackedConversations([sft_file], 512, "train")
    assert windows.truncated == windows.dropped == 0 and 1 < len(windows) < len(starts) - 1
    seen = []
    for x, y, positions in (windows[i] for i in range(len(windows))):
        begins = (positions == 0).nonzero().flatten().tolist() + [512]
        for a, b in zip(begins[:-1], begins[1:]):
            if y[a:b].eq(IGNORE_INDEX).all() and a == begins[-2] and b == 512:
                continue                                   # the padding: no targets
            s = int(starts[len(seen)])
            n = b - a
            assert x[a:b].tolist() == tokens[s:s + n].tolist(), "whole conversations, in order"
            expected = [int(t) if m else IGNORE_INDEX for t, m in zip(tokens[s + 1:s + n], targets[s + 1:s + n])]
            assert y[a:b - 1].tolist() == expected and y[b - 1] == IGNORE_INDEX
            seen.append(s)
    assert seen == starts[:len(seen)].tolist() and len(seen) == len(starts) - 1, "every training conversation once"


def test_a_conversation_longer_than_the_window_is_truncated(sft_file):
    starts = np.fromfile(data.sft_file(sft_file, "starts"), dtype=np.int64)
    longest = int(np.diff(starts).max())
    windows = data.PackedConversations([sft_file], longest - 1, "train")
    assert windows.truncated >= 1 and all(len(windows[i][0]) == longest - 1 for i in range(len(windows)))


def test_a_packed_window_from_the_loader_gives_each_conversations_own_loss(sft_file):
    """A real window (the Llama 3.2 folder's tokens, its chat template): float32, as the row above, 1e-5 relative."""
    vocab = data.read_meta(sft_file)["vocab_size"]
    model = Llama(LlamaArgs(vocab_size=-(-vocab // 64) * 64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                            max_seq_len=512, multiple_of=32))
    model.init_weights(3)
    x, y, positions = (t[None] for t in data.PackedConversations([sft_file], 512, "train")[0])
    begins = (positions[0] == 0).nonzero().flatten().tolist() + [512]
    assert len(begins) > 3, "two conversations or more, and the padding"
    count = int((y != IGNORE_INDEX).sum())
    packed = _loss_and_grads(model, cross_entropy(model(x, positions=positions), y))
    total = sum(cross_entropy(model(x[:, a:b]), y[:, a:b], reduction="sum") for a, b in zip(begins, begins[1:]))
    one_by_one = _loss_and_grads(model, total / count)
    assert abs(packed[0] - one_by_one[0]) <= 1e-5 * one_by_one[0]
    for name, grad in one_by_one[1].items():
        torch.testing.assert_close(packed[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def _batches(paths, dp, steps, state=None, global_batch=4):
    """The global batches of `steps` steps: each data-parallel rank's batch, in rank order, joined."""
    loaders = [data.sft_loader(paths, 512, global_batch // dp, r, dp, global_batch, seed=5) for r in range(dp)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    batches = [iter(loader) for loader in loaders]
    out = [[torch.cat(parts) for parts in zip(*(next(b) for b in batches))] for _ in range(steps)]
    return out, loaders[0].state_dict()


def test_the_sft_loader_resumes_exactly_and_splits_alike_over_data_parallel_ranks(sft_file):
    whole, _ = _batches([sft_file], 1, 5)
    first, state = _batches([sft_file], 2, 2)
    rest, _ = _batches([sft_file], 2, 3, state)
    assert all(len(batch) == 3 for batch in whole), "inputs, targets, positions"
    for a, b in zip(whole, first + rest):          # five steps cross an epoch's end
        assert all(torch.equal(u, v) for u, v in zip(a, b))
    held_out = list(data.sft_eval_batches([sft_file], 512, 1, 0, 1, 8))
    assert len(held_out) == 1 and held_out[0][2][0, 0] == 0


def test_what_sft_does_not_take_is_refused_in_one_line(sft_file, tmp_path):
    data.check_sft([sft_file])
    for kwargs, message in (({"cp": 2}, "--cp"), ({"pp": 2}, "--pp")):
        with pytest.raises(ValueError, match=message):
            data.check_sft([sft_file], **kwargs)
    plain = data.prepare(["some text " * 50], tmp_path / "plain.bin")
    with pytest.raises(ValueError, match="prepare --sft"):
        data.check_sft([plain])
    with pytest.raises(ValueError, match="prepare --sft"):
        data.PackedConversations([plain], 64, "train")


def test_prepare_sft_refuses_in_one_line(downloads, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"text": "not a conversation"}\n')
    for argv, message in ((["--sft", str(downloads.chat)], "--sft needs --tokenizer"),
                          (["--sft", str(bad), "--tokenizer", str(downloads.llama3)], "line 2: not a conversation")):
        with pytest.raises(SystemExit) as refused:
            data.main(argv + ["--out", str(tmp_path / "x.bin")])
        lines = capsys.readouterr().err.strip().splitlines()
        assert refused.value.code == 2 and len(lines) == 1 and message in lines[0], lines
