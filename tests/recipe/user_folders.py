"""Folders shaped as users download them, built by `transformers`' own `save_pretrained`: what the recipe must read.

The recipe's own tests used to feed it only what it wrote itself (a byte-level BPE with GPT-2's `<|endoftext|>`, a
config.json from its own `hf_config`). A user brings a Llama 2 or a Llama 3.2 download instead, whose tokenizers
spell their special tokens differently, add a beginning-of-sequence token by themselves, and come with
`tokenizer_config.json`, `special_tokens_map.json` and `generation_config.json` beside `tokenizer.json`. These
builders make small folders of those shapes offline (tokenizers trained here on CPython's language reference, a few
hundred tokens of vocabulary, a two-layer model), so every test can hold the recipe against them:

- `gpt2_tokenizer(folder)`: a byte-level BPE whose one special token `<|endoftext|>` is BOS, EOS and UNK, with no
  post-processor (GPT-2's shape: documents are separated, not opened);
- `llama2_folder(folder)`: Llama 2's shape: `<unk>`, `<s>`, `</s>` at ids 0-2, the 256 byte tokens `<0x00>`..`<0xFF>`
  (byte fallback), a Metaspace BPE (`▁` for spaces), `<s>` added by the tokenizer itself; fp16 safetensors;
- `llama3_folder(folder)`: Llama 3.2's shape: a byte-level BPE with `<|begin_of_text|>` added by a
  TemplateProcessing post-processor, `<|end_of_text|>` as EOS, the chat header and `<|eot_id|>` tokens, a chat
  template, tied embeddings, 131,072 positions with llama3 rope scaling, a list of EOS ids in
  `generation_config.json`, bf16 safetensors;
- `as_on_the_hub(folder, ...)`: both Llama folders are rewritten into the layout of the downloads on the Hub
  (written by older transformers releases: `torch_dtype`, `rope_scaling`, the chat template inside
  tokenizer_config.json, special_tokens_map.json);
- `chat_file(path)`: a JSON-lines file of conversations (`{"messages": [{"role": ..., "content": ...}, ...]}`), as
  the chat data sets on the Hub store them.

Each builder returns the folder (or file) it wrote; `Shape` says what a test may expect of it.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

CORPUS_DOCS = 400          # the language reference's first topics: enough text for a few hundred merges

LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


@dataclasses.dataclass(frozen=True)
class Shape:
    """What a folder's tokenizer does, as a test checks it: its BOS and EOS tokens (EOS ids as generation_config.json
    lists them), and whether encoding a text adds the BOS by itself."""
    bos: str | None
    eos: str
    eos_ids: tuple[int, ...]
    adds_bos: bool
    chat_template: bool


def corpus() -> list[str]:
    """Documents of real English and code, shipped with Python (no download): CPython's language reference."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)][:CORPUS_DOCS]


def _trained_bpe(pre_tokenizer, vocab_size: int, special: list[str], alphabet: list[str]):
    from tokenizers import Tokenizer, models, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=alphabet)
    tok.train_from_iterator(corpus(), trainer)
    model = json.loads(tok.to_str())["model"]
    return model["vocab"], [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]


def gpt2_tokenizer(folder: str | Path, vocab_size: int = 400) -> Path:
    """GPT-2's shape, saved by transformers' GPT2Tokenizer."""
    from tokenizers import pre_tokenizers
    from transformers import GPT2Tokenizer

    vocab, merges = _trained_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False), vocab_size, ["<|endoftext|>"],
                                 pre_tokenizers.ByteLevel.alphabet())
    tokenizer = GPT2Tokenizer(vocab=vocab, merges=merges, unk_token="<|endoftext|>", bos_token="<|endoftext|>",
                              eos_token="<|endoftext|>")
    folder = Path(folder)
    tokenizer.save_pretrained(folder)
    return folder


GPT2_SHAPE = Shape(bos=None, eos="<|endoftext|>", eos_ids=(), adds_bos=False, chat_template=False)


def llama2_tokenizer(folder: str | Path, vocab_size: int = 600):
    """Llama 2's shape, saved by transformers' LlamaTokenizer (Metaspace, byte fallback, `<s>` added)."""
    from tokenizers import pre_tokenizers
    from transformers import LlamaTokenizer

    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trained, merges = _trained_bpe(pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False),
                                   vocab_size, [], [])
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", *byte_tokens])}
    for token in sorted(trained, key=trained.get):
        vocab.setdefault(token, len(vocab))
    tokenizer = LlamaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)     # as Llama 2 ships it
    folder = Path(folder)
    tokenizer.save_pretrained(folder)
    return tokenizer


LLAMA2_SHAPE = Shape(bos="<s>", eos="</s>", eos_ids=(2,), adds_bos=True, chat_template=False)


def llama3_tokenizer(folder: str | Path, vocab_size: int = 500):
    """Llama 3's shape, saved by transformers' PreTrainedTokenizerFast from a tokenizer.json of Llama 3's kind."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    vocab, merges = _trained_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False), vocab_size, [],
                                 pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(special)                      # after the vocabulary, as Llama 3's 128000..128255
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                      special_tokens=[("<|begin_of_text|>", bos)])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                        eos_token="<|end_of_text|>", model_max_length=131072,
                                        chat_template=LLAMA3_CHAT_TEMPLATE)
    folder = Path(folder)
    tokenizer.save_pretrained(folder)
    return tokenizer


def _llama(folder: Path, tokenizer, dtype, eos_ids: list[int], **config):
    """A two-layer LlamaForCausalLM of random weights with `config`'s fields, saved with its generation config."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    vocab = -(-len(tokenizer) // 64) * 64                 # rows past the tokenizer's, as downloads pad theirs
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=eos_ids[0], **config)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(dtype)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=eos_ids if len(eos_ids) > 1 else eos_ids[0])
    model.save_pretrained(folder)
    return folder


def as_on_the_hub(folder: Path, tokenizer_class: str) -> Path:
    """Rewrite what this transformers (5.x) saved into the layout of the downloads on the Hub, which older releases
    wrote: config.json's `torch_dtype`, `rope_theta` and `rope_scaling` (5.x: `dtype` and `rope_parameters`), the
    chat template inside tokenizer_config.json (5.x: chat_template.jinja), a special_tokens_map.json, and the
    tokenizer class the download names. A reader must take both."""
    config = json.loads((folder / "config.json").read_text())
    config["torch_dtype"] = config.pop("dtype")
    rope = config.pop("rope_parameters", None) or {}
    config["rope_theta"] = rope.pop("rope_theta", 10000.0)
    config["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    template = folder / "chat_template.jinja"
    if template.exists():
        tok_config["chat_template"] = template.read_text()
        template.unlink()
    tok_config["tokenizer_class"] = tokenizer_class
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    special = {k: tok_config[k] for k in ("bos_token", "eos_token", "unk_token") if tok_config.get(k)}
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    return folder


def llama2_folder(folder: str | Path) -> Path:
    """A Llama 2 download in small: its tokenizer's shape, untied embeddings, 4,096 positions, fp16 weights, in the
    Hub's layout."""
    import torch

    folder = Path(folder)
    tokenizer = llama2_tokenizer(folder)
    _llama(folder, tokenizer, torch.float16, [tokenizer.eos_token_id], max_position_embeddings=4096,
           rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    return as_on_the_hub(folder, "LlamaTokenizer")


def llama3_folder(folder: str | Path) -> Path:
    """A Llama 3.2 download in small: its tokenizer's shape, tied embeddings, 131,072 positions with llama3 rope
    scaling, three EOS ids in generation_config.json (end of text, end of message, end of turn), bf16 weights, in
    the Hub's layout."""
    import torch

    folder = Path(folder)
    tokenizer = llama3_tokenizer(folder)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|end_of_text|>", "<|end_header_id|>", "<|eot_id|>")]
    _llama(folder, tokenizer, torch.bfloat16, ids, max_position_embeddings=131072, rms_norm_eps=1e-5,
           rope_theta=500000.0, tie_word_embeddings=True,
           rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192})
    return as_on_the_hub(folder, "PreTrainedTokenizerFast")


LLAMA3_SHAPE = Shape(bos="<|begin_of_text|>", eos="<|end_of_text|>", eos_ids=(), adds_bos=True, chat_template=True)


def chat_file(path: str | Path, conversations: int = 24) -> Path:
    """Conversations of a system prompt, a question and an answer (some with a second turn), in the Hub's chat
    format, their text taken from the language reference so that every tokenizer here covers it."""
    docs = corpus()
    lines = []
    for i in range(conversations):
        text = docs[(7 * i) % len(docs)].split()
        messages = [{"role": "system", "content": "You answer questions about Python."},
                    {"role": "user", "content": "Explain: " + " ".join(text[:8 + i % 5])},
                    {"role": "assistant", "content": " ".join(text[8:30 + 3 * (i % 4)])}]
        if i % 3 == 0:
            messages += [{"role": "user", "content": "And then?"},
                         {"role": "assistant", "content": " ".join(text[30:42])}]
        lines.append(json.dumps({"messages": messages}))
    path = Path(path)
    path.write_text("\n".join(lines) + "\n")
    return path
