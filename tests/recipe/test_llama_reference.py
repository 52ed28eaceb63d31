"""The recipe's model (scripts/train/model.py) held against the reference implementation of Llama, `transformers`'
`LlamaForCausalLM`: the same weights (converted by model.py's `to_hf`) give the same logits in float32, for an
untied and a tied output, for grouped-query attention and for Llama 3.1's rope scaling; the conversion's reordering
of wq and wk is what makes them equal (without it they differ); the presets have the published models' sizes; the
key/value cache changes no logit.
"""
from __future__ import annotations

import sys

import pytest
import torch

from helpers.paths import SCRIPTS

sys.path.insert(0, str(SCRIPTS / "train"))
from config import LlamaArgs, config_from_hf, hf_config, preset  # noqa: E402
from model import Llama, KVCache, from_hf, to_hf  # noqa: E402

# float32 on the CPU: the two implementations differ only in the order of a few sums (measured: about 2e-7 of logits
# near 1); a wrong rotation, a head mapped to the wrong key/value group or a missing scale moves them by 0.1 or more
ATOL = 1e-5
SMALL = dict(vocab_size=97, dim=64, n_layers=2, n_heads=4, max_seq_len=48, multiple_of=32)
LLAMA31_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 16}


def _pair(convert=to_hf, **shape):
    """Our model with seeded weights, and transformers' Llama holding the same weights (converted by `convert`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaArgs(**{**SMALL, **shape})
    ours = Llama(cfg)
    ours.init_weights(seed=7)
    with torch.no_grad():        # sharper attention than at initialisation (a trained model's): where positions matter
        for name, p in ours.named_parameters():
            p.mul_(20 if name.endswith(("wq.weight", "wk.weight")) else 1)
    theirs = LlamaForCausalLM(LlamaConfig(**hf_config(cfg))).eval()
    state = dict(convert(name, t, cfg) for name, t in ours.state_dict().items())
    if cfg.tie_embeddings:
        state.pop("lm_head.weight")       # Hugging Face stores a tied output once
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert unexpected == [] and missing == (["lm_head.weight"] if cfg.tie_embeddings else [])
    return ours.eval(), theirs


TOKENS = torch.randint(0, SMALL["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("shape", [{}, {"tie_embeddings": True}, {"n_kv_heads": 2}, {"n_kv_heads": 1},
                                   {"rope_theta": 500000.0, "rope_scaling": LLAMA31_SCALING}],
                         ids=["untied", "tied", "gqa-2", "gqa-1", "llama3.1-rope"])
def test_the_same_weights_give_transformers_logits(shape):
    ours, theirs = _pair(**shape)
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS), theirs(TOKENS).logits, rtol=0, atol=ATOL)


def test_without_the_rotary_reordering_the_logits_differ():
    """Meta's rotary pairs neighbours (x[2i], x[2i+1]), Hugging Face pairs halves (x[i], x[i + d/2]): the weights
    copied under the right names but not reordered give another model."""
    ours, theirs = _pair(convert=lambda name, t, cfg: (to_hf(name, t, cfg)[0], t), n_kv_heads=2)
    with torch.no_grad():
        gap = (ours(TOKENS) - theirs(TOKENS).logits).abs().max().item()
    assert gap > 1e3 * ATOL, gap


def test_the_conversion_round_trips_and_the_config_reads_back():
    cfg = LlamaArgs(**SMALL, n_kv_heads=2, tie_embeddings=True, rope_scaling=LLAMA31_SCALING)
    model = Llama(cfg)
    model.init_weights(seed=1)
    for name, t in model.state_dict().items():
        assert torch.equal(from_hf(name, to_hf(name, t, cfg)[1], cfg), t), name
    back = config_from_hf(hf_config(cfg))
    assert (back.vocab_size, back.dim, back.n_layers, back.n_heads, back.n_kv_heads, back.hidden, back.max_seq_len,
            back.rope_scaling, back.tie_embeddings) == (cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.n_heads,
                                                        cfg.n_kv_heads, cfg.hidden, cfg.max_seq_len,
                                                        cfg.rope_scaling, cfg.tie_embeddings)


def test_transformers_own_config_reads_back_as_the_same_model():
    """A config.json as transformers 5 writes it (rope_parameters instead of rope_theta and rope_scaling)."""
    from transformers import LlamaConfig

    cfg = LlamaArgs(**SMALL, n_kv_heads=2, rope_theta=500000.0, rope_scaling=LLAMA31_SCALING)
    written = LlamaConfig(**hf_config(cfg)).to_dict()
    back = config_from_hf(written)
    assert (back.rope_theta, back.rope_scaling, back.n_kv_heads, back.hidden) == \
        (cfg.rope_theta, cfg.rope_scaling, cfg.n_kv_heads, cfg.hidden)


@pytest.mark.parametrize("bad, message", [({"model_type": "gpt2"}, "is not 'llama'"),
                                          ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
                                          ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'")])
def test_a_config_that_is_not_this_llama_is_refused_in_one_line(bad, message):
    with pytest.raises(ValueError, match=message) as refused:
        config_from_hf({**hf_config(LlamaArgs(**SMALL)), **bad})
    assert "\n" not in str(refused.value)


# (preset, parameters, intermediate_size) as the released models' config.json files give them: Llama 2 7B's
# 6,738,415,616 parameters; Llama 3 8B's 8,030,261,248; 70B's 70,553,706,496; 405B's 405,853,388,800
PUBLISHED = [("llama2-7b", 6_738_415_616, 11008), ("llama3-8b", 8_030_261_248, 14336),
             ("llama3-70b", 70_553_706_496, 28672), ("llama3-405b", 405_853_388_800, 53248)]


@pytest.mark.parametrize("name, parameters, hidden", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_the_presets_have_the_released_models_sizes(name, parameters, hidden):
    cfg = preset(name)
    assert cfg.hidden == hidden, "Llama's rounding of 2/3 x 4 x dim x multiplier to multiple_of"
    assert cfg.num_params() == parameters
    with torch.device("meta"):
        assert sum(p.numel() for p in Llama(preset(name, n_layers=1)).parameters()) == \
            preset(name, n_layers=1).num_params(), "the formula counts what the module holds"


@pytest.mark.parametrize("n_kv_heads", [4, 1])
def test_the_key_value_cache_changes_no_logit(n_kv_heads):
    """Prefill 10 tokens, then one at a time, then 15 at once after cached ones: the logits of a single pass."""
    model = Llama(LlamaArgs(**SMALL, n_kv_heads=n_kv_heads)).eval()
    model.init_weights(seed=3)
    with torch.no_grad():
        whole = model(TOKENS)
        cache = KVCache(model.cfg, 2, 40)
        pieces = [model(TOKENS[:, :10], cache)] + [model(TOKENS[:, i:i + 1], cache) for i in range(10, 25)]
        pieces.append(model(TOKENS[:, 25:], cache))
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, rtol=0, atol=ATOL)
    assert cache.k.shape[2] == n_kv_heads, "the cache holds the key/value heads only"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 CUDA kernels: a GPU machine's check")
def test_in_bf16_on_a_gpu_ours_is_as_close_to_float32_as_transformers_own_bf16():
    """On a GPU both models run in bf16, each with its own kernels and rounding: ours must land as near the float32
    logits as transformers' Llama does from the same weights (within twice its gap), and bf16 must have rounded."""
    ours, theirs = _pair(n_kv_heads=2, rope_theta=500000.0, rope_scaling=LLAMA31_SCALING)
    ours, theirs, tokens = ours.cuda(), theirs.cuda(), TOKENS.cuda()
    with torch.no_grad():
        exact = ours(tokens).float()
        torch.testing.assert_close(theirs(tokens).logits.float(), exact, rtol=0, atol=1e-4)   # fp32 on the GPU
        ours_gap = (ours.bfloat16()(tokens).float() - exact).abs().max().item()
        theirs_gap = (theirs.bfloat16()(tokens).logits.float() - exact).abs().max().item()
    print(f"bf16 logits against float32: ours {ours_gap:.3g}, transformers' {theirs_gap:.3g}")
    assert theirs_gap > 0, "bf16 rounded the reference: the comparison has a scale"
    assert ours_gap <= 2 * theirs_gap, (ours_gap, theirs_gap)


def test_a_tied_output_stays_tied_when_the_model_is_made_real_from_the_meta_device():
    """Module.to_empty gives every module a parameter of its own: a one-process or DDP run (no FSDP2, which keeps
    the tie) trained the embedding and the output apart, and --init-from a tied folder found no lm_head to load."""
    with torch.device("meta"):
        model = Llama(LlamaArgs(**SMALL, tie_embeddings=True))
    model.to_empty(device="cpu")
    assert model.output.weight is model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == model.cfg.num_params(), "one matrix, counted once"
