"""The recipe's tests share folders shaped as users download them (`user_folders`), built once per test process."""
from __future__ import annotations

import types

import pytest

import user_folders


@pytest.fixture(scope="session")
def downloads(tmp_path_factory):
    """A GPT-2 tokenizer folder, a Llama 2 and a Llama 3.2 folder (tokenizer, config, weights, generation config),
    and a chat file: `downloads.gpt2`, `.llama2`, `.llama3`, `.chat`."""
    root = tmp_path_factory.mktemp("downloads")
    return types.SimpleNamespace(gpt2=user_folders.gpt2_tokenizer(root / "gpt2"),
                                 llama2=user_folders.llama2_folder(root / "llama2"),
                                 llama3=user_folders.llama3_folder(root / "llama3"),
                                 chat=user_folders.chat_file(root / "chat.jsonl"))
