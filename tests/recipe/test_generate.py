"""scripts/train/generate.py (made of notebook 06's cells) on folders shaped as users download them
(tests/recipe/user_folders.py): a Llama 3.2 folder's generation stops at any of the end-of-text ids its
generation_config.json lists (end of text, of a header, of a turn), not only at config.json's one; a folder loads in
its own dtype, built on the meta device and read straight into place (no float32 model, no initialisation drawn
first); bad input is one line on stderr and exit status 2."""
from __future__ import annotations

import sys

import pytest
import torch

from helpers.paths import SCRIPTS

sys.path.insert(0, str(SCRIPTS / "train"))
import generate  # noqa: E402


class Scripted(torch.nn.Module):
    """A model whose next tokens are `script`'s, in order: its logits, with all but the scripted id pushed down."""

    def __init__(self, model, script):
        super().__init__()
        self.model, self.script, self.cfg = model, list(script), model.cfg

    def forward(self, tokens, cache=None):
        logits = self.model(tokens, cache)
        logits[0, -1] = torch.where(torch.arange(logits.shape[-1]) == self.script.pop(0), 0.0, -1e4)
        return logits


def test_generation_stops_at_any_end_of_text_id_generation_config_lists(downloads):
    from transformers import GenerationConfig

    model, tokenizer = generate.load(downloads.llama3)
    codec = generate.Codec(tokenizer)
    listed = GenerationConfig.from_pretrained(downloads.llama3).eos_token_id
    assert codec.eos_ids == listed and len(listed) == 3, "the list generation_config.json holds"
    prompt = codec.encode("The with statement")
    for last in listed:
        said = generate.generate(Scripted(model, [40, 41, last, 42, 43]), prompt, 5, stop_at=codec.eos_ids)
        assert said == [40, 41, last], f"generation goes on past {last}"
    said = generate.generate(Scripted(model, [40, 41, listed[-1], 42, 43]), prompt, 5, stop_at=listed[:1])
    assert said == [40, 41, listed[-1], 42, 43], "config.json's one id alone misses the end of a turn"


def test_a_folder_loads_in_its_dtype_read_into_a_model_built_empty(downloads, monkeypatch):
    """The Llama 3.2 folder's bf16 weights, exactly, in a bf16 model, its rotary tables float32 as training's; no
    parameter initialised on the way (nn.Linear's and nn.Embedding's own initialisers run on the meta device only)."""
    from safetensors.torch import load_file

    from model import Llama, rope_tables

    drawn = []

    def counted(real):
        def init(tensor, *args, **kwargs):
            if not tensor.is_meta:        # on the meta device an initialiser draws nothing
                drawn.append(tensor.numel())
            return real(tensor, *args, **kwargs)
        return init

    for name in ("kaiming_uniform_", "normal_", "uniform_"):
        monkeypatch.setattr(torch.nn.init, name, counted(getattr(torch.nn.init, name)))
    model, _ = generate.load(downloads.llama3)
    assert drawn == [], f"initialised {sum(drawn)} numbers before loading"
    stored = load_file(downloads.llama3 / "model.safetensors")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.equal(model.tok_embeddings.weight, stored["model.embed_tokens.weight"])
    assert model.output.weight is model.tok_embeddings.weight, "Llama 3.2's tied output stays tied"
    assert torch.equal(model.rope_cos, rope_tables(model.cfg)[0]) and model.rope_cos.dtype == torch.float32
    fp32, _ = generate.load(downloads.llama3, dtype=torch.float32)
    reference = Llama(fp32.cfg)
    import checkpoint

    checkpoint.load_hf(reference, downloads.llama3)
    tokens = torch.tensor([[1, 5, 9, 200, 301]])
    with torch.no_grad():
        torch.testing.assert_close(fp32(tokens), reference(tokens), rtol=0, atol=0)


@pytest.mark.parametrize("flags, says", [
    (["--device", "cuda"], "this machine has no CUDA device"),
    (["--device", "tpu9"], "--device tpu9:"),
    (["--tokenizer", "no_such_tokenizer"], "no_such_tokenizer: no such file or folder"),
    (["--max-new-tokens", "200000"], "between 1 and the model's max_seq_len"),
    (["--top-k", "0"], "--top-k >= 1"),
    (["--dtype", "fp8"], "invalid choice: 'fp8'")], ids=["cuda", "device", "tokenizer", "long", "top_k", "dtype"])
def test_bad_input_is_one_line_and_status_2(downloads, capsys, flags, says):
    if flags[:2] == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as refused:
        generate.main(["--model", str(downloads.llama2), "--prompt", "Hello", *flags])
    lines = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and len(lines) == 1 and says in lines[0], lines
