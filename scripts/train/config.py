# From the PyTorch distributed cookbook: the cells tagged 'script:train/config.py' in
#   notebooks/03_fsdp_and_device_mesh.ipynb
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
"""What a run is, torch-free: the model's shape (`LlamaArgs`, named presets from a tiny CPU model to Llama 3 405B, the
mapping to and from a Hugging Face Llama's config.json) and the parallel layout (`Layout`: the degrees of the named
mesh, the one check of what a world size and a model can take, the pipeline's split of the layers). model.py builds
the model from it, parallelize.py the mesh, and the planner (plan.py) reads it without importing torch.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LlamaArgs:
    """The model's shape. The feed-forward width is Llama's rule: 2/3 of 4 x dim, times `ffn_dim_multiplier`,
    rounded up to a multiple of `multiple_of` (Llama 2 7B: 11008; Llama 3 8B: 14336), unless `ffn_hidden` gives it
    (a Hugging Face config's `intermediate_size`). `n_kv_heads` < `n_heads` is grouped-query attention: each
    key/value head serves n_heads / n_kv_heads query heads. `rope_scaling` is Llama 3.1's long-context rule
    (`factor`, `low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`), None for plain RoPE."""

    vocab_size: int = 256
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    n_kv_heads: int | None = None      # None: as many as n_heads (multi-head attention)
    max_seq_len: int = 1024
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    ffn_hidden: int | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_embeddings: bool = False

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.dim % self.n_heads:
            raise ValueError(f"n_heads {self.n_heads} must divide dim {self.dim}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads {self.n_kv_heads} must divide n_heads {self.n_heads} (each key/value head "
                             "serves a whole group of query heads)")
        if self.head_dim % 2:
            raise ValueError(f"the head dimension dim / n_heads = {self.head_dim} must be even (rotary pairs)")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * -(-hidden // self.multiple_of)

    def num_params(self) -> int:
        """Every weight: the embedding, per block two norms, wq and wo (dim x dim), wk and wv (dim x kv_dim), w1, w3
        and w2 (dim x hidden), the final norm, and the output unless it is the embedding (tied)."""
        v, d, h, kv = self.vocab_size, self.dim, self.hidden, self.n_kv_heads * self.head_dim
        block = 2 * d * d + 2 * d * kv + 3 * d * h + 2 * d
        return v * d + self.n_layers * block + d + (0 if self.tie_embeddings else d * v)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token, forward and backward (3 x the forward's 2 FLOPs per multiply-add): 6 per weight
        of every matmul (the output layer included, tied or not; the embedding lookup is no matmul), plus
        12 x layers x dim x seq_len for the attention scores and their use (QK^T and AV). Causal masking is not
        discounted: the convention of PaLM's appendix B, nanoGPT and torchtitan, so an MFU computed from it compares
        with theirs (plan.py uses this function too)."""
        d, h, kv, n = self.dim, self.hidden, self.n_kv_heads * self.head_dim, self.n_layers
        matmul_weights = n * (2 * d * d + 2 * d * kv + 3 * d * h) + d * self.vocab_size
        return 6 * matmul_weights + 12 * n * d * seq_len


# Named shapes. `tiny` and `small` train here (their vocabulary is the token file's); the Llama shapes are those of
# Meta's releases (their params.json, and Hugging Face's config.json of the same models), for the planner and for
# --init-from: nobody trains those on a laptop.
PRESETS = {
    "tiny": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=128),
    "small": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, multiple_of=256, max_seq_len=1024),
    "llama2-7b": dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, multiple_of=256,
                      max_seq_len=4096, rope_theta=10000.0),
    "llama3-8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, multiple_of=1024,
                      ffn_dim_multiplier=1.3, max_seq_len=8192, rope_theta=500000.0),
    "llama3-70b": dict(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, multiple_of=4096,
                       ffn_dim_multiplier=1.3, max_seq_len=8192, rope_theta=500000.0),
    "llama3-405b": dict(vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, multiple_of=4096,
                        ffn_dim_multiplier=1.2, max_seq_len=8192, rope_theta=500000.0),
}


def preset(name: str, **overrides) -> LlamaArgs:
    """A named shape, with some fields changed (`preset("llama3-8b", n_layers=2)`)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}: one of {', '.join(PRESETS)}")
    return LlamaArgs(**{**PRESETS[name], **overrides})


def hf_config(cfg: LlamaArgs, dtype: str = "float32") -> dict:
    """The config.json `LlamaForCausalLM.from_pretrained` reads for this model (the classic keys, which
    transformers 4 and 5, vLLM and the evaluation harnesses all read; the weights' dtype under both its names,
    transformers 4's `torch_dtype` and 5's `dtype`)."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
              "hidden_size": cfg.dim, "intermediate_size": cfg.hidden, "num_hidden_layers": cfg.n_layers,
              "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
              "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
              "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
              "mlp_bias": False, "torch_dtype": dtype, "dtype": dtype}
    if cfg.rope_scaling:
        config["rope_scaling"] = {"rope_type": "llama3", **cfg.rope_scaling}
    return config


def config_from_hf(config: dict) -> LlamaArgs:
    """Our config for a Hugging Face Llama's config.json; ValueError (one line) for anything this model is not."""
    if config.get("model_type") != "llama":
        raise ValueError(f"model_type {config.get('model_type')!r} is not 'llama' (architectures: "
                         f"{config.get('architectures')})")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if config.get(key, want) != want:
            raise ValueError(f"{key} {config[key]!r}: this model is a Llama with {key} {want!r}")
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})   # transformers 5 / 4 names
    theta = rope.pop("rope_theta", config.get("rope_theta", 10000.0))
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    if kind not in ("default", "llama3"):
        raise ValueError(f"rope_type {kind!r}: only plain RoPE and Llama 3.1's 'llama3' scaling are implemented")
    heads = config["num_attention_heads"]
    if config.get("head_dim", config["hidden_size"] // heads) != config["hidden_size"] // heads:
        raise ValueError(f"head_dim {config['head_dim']} is not hidden_size / num_attention_heads")
    scaling = {k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                    "original_max_position_embeddings")} if kind == "llama3" else None
    return LlamaArgs(vocab_size=config["vocab_size"], dim=config["hidden_size"], n_layers=config["num_hidden_layers"],
                     n_heads=heads, n_kv_heads=config.get("num_key_value_heads") or heads,
                     max_seq_len=config["max_position_embeddings"], ffn_hidden=config["intermediate_size"],
                     norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=scaling,
                     tie_embeddings=bool(config.get("tie_word_embeddings", False)))


# ------------------------------------------------------------------------------------------------------ the layout
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")    # the recipe's mesh, slowest first: tp ranks are neighbours


@dataclass(frozen=True)
class Layout:
    """How many ranks along each mesh dimension (the world size is their product), and what the recipe applies at
    it: FSDP2 where it shards, and for the replicas beside tensor or pipeline parallelism (HSDP with one shard);
    DDP where it only replicates."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: those that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> bool:
        return self.dp_shard > 1 or (self.dp_replicate > 1 and (self.tp > 1 or self.pp > 1))

    @property
    def ddp(self) -> bool:
        return self.dp_replicate > 1 and not self.fsdp

    def check(self, world: int | None = None, cfg: LlamaArgs | None = None, seq_len: int | None = None) -> None:
        """ValueError (one line) for a layout this world size or this model cannot take."""
        bad = [f"{name} {d}" for name, d in vars(self).items() if d < 1]
        if bad:
            raise ValueError(f"parallel degrees must be at least 1, got {', '.join(bad)}")
        if world is not None and self.world != world:
            raise ValueError(f"pp {self.pp} x dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x tp "
                             f"{self.tp} = {self.world}, but the world size is {world}")
        if cfg is None:
            return
        if cfg.n_heads % self.tp or cfg.n_kv_heads % self.tp:
            raise ValueError(f"tp {self.tp} must divide the {cfg.n_heads} query and {cfg.n_kv_heads} key/value heads "
                             "(each rank takes whole heads)")
        if cfg.vocab_size % self.tp:
            raise ValueError(f"tp {self.tp} must divide the vocabulary size {cfg.vocab_size} (the output layer is split)")
        if cfg.n_layers < self.pp:
            raise ValueError(f"pp {self.pp} stages need at least as many layers, not {cfg.n_layers}")
        if self.pp > 1 and cfg.tie_embeddings:
            raise ValueError("a tied output cannot be pipelined: the embedding lives on the first stage, the output on "
                             "the last")
        if seq_len is not None and seq_len % self.tp:
            raise ValueError(f"tp {self.tp} must divide the sequence length {seq_len} (sequence parallel splits it)")


def stage_layers(n_layers: int, n_stages: int, stage: int) -> range:
    """The layers pipeline stage `stage` of `n_stages` owns, as torchtitan splits them: the embedding and the output
    count as one layer each, the n_layers + 2 are shared out evenly and the first stages take one more each when
    they do not divide (126 layers over 8 stages: the first stage the embedding and 15 layers, the next six 16, the
    last 15 and the output)."""
    effective = n_layers + 2
    per, extra = divmod(effective, n_stages)
    sizes = [per + (s < extra) for s in range(n_stages)]
    start = sum(sizes[:stage]) - (stage > 0)            # the embedding's share of the first stage is no layer
    stop = sum(sizes[:stage + 1]) - 1 - (stage == n_stages - 1)
    return range(max(0, start), min(n_layers, stop))
