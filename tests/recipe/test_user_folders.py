"""The folders the recipe's tests hand it are the shapes users download (tests/recipe/user_folders.py): held against
`transformers`, which reads them as it reads the real ones."""
from __future__ import annotations

import json

import pytest

from user_folders import GPT2_SHAPE, LLAMA2_SHAPE, LLAMA3_SHAPE

TEXT = "The for statement iterates over the elements of a sequence: wörld ☃"


@pytest.mark.parametrize("name, shape", [("gpt2", GPT2_SHAPE), ("llama2", LLAMA2_SHAPE), ("llama3", LLAMA3_SHAPE)])
def test_each_folder_has_its_downloads_special_tokens(downloads, name, shape):
    from transformers import AutoTokenizer

    folder = getattr(downloads, name)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(TEXT).input_ids
    assert (ids[0] == tokenizer.bos_token_id) == shape.adds_bos
    assert tokenizer.eos_token == shape.eos
    assert tokenizer.decode(ids, skip_special_tokens=True) == TEXT          # byte-level or byte fallback: exact
    assert bool(tokenizer.chat_template) == shape.chat_template


def test_the_llama_folders_are_what_their_downloads_are(downloads):
    from transformers import AutoConfig, GenerationConfig

    llama2, llama3 = AutoConfig.from_pretrained(downloads.llama2), AutoConfig.from_pretrained(downloads.llama3)
    assert (llama2.tie_word_embeddings, llama2.max_position_embeddings, str(llama2.dtype)) == \
        (False, 4096, "torch.float16")
    assert (llama3.tie_word_embeddings, llama3.max_position_embeddings, str(llama3.dtype)) == \
        (True, 131072, "torch.bfloat16")
    assert llama3.rope_parameters["rope_type"] == "llama3"          # read from the Hub layout's rope_scaling
    eos = GenerationConfig.from_pretrained(downloads.llama3).eos_token_id
    assert isinstance(eos, list) and len(eos) == 3
    lines = [json.loads(line) for line in downloads.chat.read_text().splitlines()]
    assert all({m["role"] for m in line["messages"]} == {"system", "user", "assistant"} for line in lines)
