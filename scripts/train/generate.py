# From the PyTorch distributed cookbook: the cells tagged 'script:train/generate.py' in
#   notebooks/06_checkpointing_and_fault_tolerance.ipynb
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
"""Look at what was trained: a prompt in, text out, from a checkpoint directory, an export or a Hugging Face folder.

    python generate.py --model ckpt --prompt "The with statement"                 # the newest checkpoint of a run
    python generate.py --model my-llama --prompt "Once" --temperature 0.8 --top-k 50   # export --format hf's folder
    python generate.py --model model.pt --prompt "def " --max-new-tokens 64           # export --format pt's file

Greedy by default (the most likely token each time), or sampled at --temperature among the --top-k most likely.
A key/value cache (model.py's KVCache) keeps every block's keys and values, so each new token runs the model on
itself alone; `--no-cache` runs the whole sequence again per token (the same tokens, slower: a test checks both).
The text is turned into tokens by the tokenizer the model was trained with: the folder's, the one the checkpoint's
token file names, or --tokenizer; bytes when the vocabulary is bytes. Generation stops at any of the tokenizer's
end-of-text ids (generation_config.json's list: Llama 3's end of text, of a message, of a turn). A Hugging Face
folder loads in its own dtype (--dtype to change it), each weight read straight into its place.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import checkpoint as ckpt
from model import Llama, KVCache


class Codec:
    """Text <-> token ids, and the ids that end a text: a Hugging Face tokenizer (a folder, a token file's, or a
    tokenizer.json, as data.read_tokenizer reads it), or UTF-8 bytes (nothing ends them)."""

    def __init__(self, tokenizer_path: str | Path | None = None):
        from data import read_tokenizer

        record = read_tokenizer(tokenizer_path) if tokenizer_path else None
        self.tokenizer = record.tokenizer if record else None
        self.eos_ids = record.eos_ids if record else []

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids if self.tokenizer else list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer else bytes(ids).decode("utf-8", errors="replace")


def load(source: str | Path, device="cpu", dtype: torch.dtype | None = None) -> tuple[Llama, str | None]:
    """(the model, in eval mode on `device`, in `dtype` (default: a Hugging Face folder's own, else float32); the
    tokenizer it was trained with, or None) from a Hugging Face folder, an export file or a checkpoint directory (a
    run's --ckpt-dir or one step_N). Built empty (`empty_model`), each weight read into its place in its dtype: no
    float32 copy on the CPU first, no initialisation to overwrite."""
    source = Path(source)
    if source.is_file():                                            # export --format pt
        return ckpt.load_exported(source, device, dtype or torch.float32), None
    step = source if (source / ".metadata").exists() else ckpt.latest(source)   # a step_N (its config.json is ours)
    if step is None and (source / "config.json").is_file():         # a Hugging Face folder
        model = ckpt.empty_model(ckpt.hf_model_config(source), device, dtype or ckpt.hf_dtype(source))
        ckpt.load_hf(model, source)
        return model.eval(), str(source) if (source / "tokenizer.json").is_file() else None
    if step is None:
        raise ValueError(f"{source}: not a Hugging Face folder, an export file or a checkpoint directory")
    cfg, config = ckpt.checkpoint_config(step)
    model = ckpt.empty_model(cfg, device, dtype or torch.float32)
    ckpt.load_in_one_process(step, model.state_dict())
    model.init_rope()
    tokenizer = (config.get("data") or {}).get("tokenizer")
    return model.eval(), tokenizer if tokenizer and Path(tokenizer).exists() else None


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator) -> int:
    """The most likely token (temperature 0), or one drawn from softmax(logits / temperature) over the top_k."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.numel():
        threshold = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1).cpu(), 1, generator=generator))


@torch.no_grad()
def generate(model: Llama, prompt: list[int], max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
             seed: int = 0, use_cache: bool = True, stop_at: list[int] | None = None) -> list[int]:
    """The ids that follow `prompt`: up to max_new_tokens, ending early at any id of `stop_at` (the tokenizer's
    end-of-text ids: `Codec.eos_ids`)."""
    total = len(prompt) + max_new_tokens
    if not prompt or total > model.cfg.max_seq_len:
        raise ValueError(f"a prompt of {len(prompt)} tokens and {max_new_tokens} new ones: between 1 and the "
                         f"model's max_seq_len {model.cfg.max_seq_len} in all")
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    cache = KVCache(model.cfg, 1, total, device, next(model.parameters()).dtype) if use_cache else None
    ids, stop = list(prompt), set(stop_at or ())
    logits = model(torch.tensor([ids], device=device), cache)[0, -1]
    for _ in range(max_new_tokens):
        ids.append(next_token(logits, temperature, top_k, generator))
        if ids[-1] in stop or len(ids) == total:
            break
        new = ids[-1:] if use_cache else ids                     # with a cache: the new token alone
        logits = model(torch.tensor([new], device=device), cache)[0, -1]
    return ids[len(prompt):]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="generate.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.error = lambda message: parser.exit(2, f"{parser.prog}: error: {message}\n")   # one line, status 2
    parser.add_argument("--model", required=True, help="a checkpoint directory, an export file or a Hugging Face "
                        "folder")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, help="sample among this many most likely tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", help="a tokenizer.json or its folder (default: the one the model was "
                        "trained with)")
    parser.add_argument("--no-cache", action="store_true", help="run the whole sequence for every new token")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="the weights' dtype (default: a Hugging "
                        "Face folder's own, else fp32)")
    args = parser.parse_args(argv)
    if not Path(args.model).exists():
        parser.error(f"--model {args.model}: no such file or directory")
    if args.temperature < 0 or args.max_new_tokens < 1 or (args.top_k is not None and args.top_k < 1):
        parser.error("--temperature must be >= 0, --max-new-tokens and --top-k >= 1")
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        parser.error(f"--device {args.device}: {str(e).splitlines()[0]}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this machine has no CUDA device")
    try:
        model, tokenizer = load(args.model, device, ckpt.WEIGHT_DTYPES.get(args.dtype))
        if args.tokenizer is None and tokenizer is None and model.cfg.vocab_size > 256:
            raise ValueError(f"the model's vocabulary is {model.cfg.vocab_size} tokens, and no tokenizer is known "
                             "for it: give --tokenizer")
        codec = Codec(args.tokenizer or tokenizer)
        ids = generate(model, codec.encode(args.prompt), args.max_new_tokens, args.temperature, args.top_k,
                       args.seed, not args.no_cache, codec.eos_ids)
    except (ValueError, OSError) as e:        # a source or tokenizer this cannot read: one line
        parser.error(str(e).splitlines()[0] if str(e) else type(e).__name__)
    print(args.prompt + codec.decode([i for i in ids if i not in codec.eos_ids]), flush=True)
    print(f"({len(ids)} tokens)", file=sys.stderr)

if __name__ == "__main__":
    main()
