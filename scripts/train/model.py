# From the PyTorch distributed cookbook: the cells tagged 'script:train/model.py' in
#   notebooks/03_fsdp_and_device_mesh.ipynb
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
"""The model every part of the recipe trains: a Llama-architecture decoder (RMSNorm, rotary position embeddings,
SwiGLU feed-forward, grouped-query attention, an optional tied output, no biases), in torchtitan's module names.

Why it looks like this: parallelism is applied to this unchanged model by the functions in parallelize.py, so the
model holds no parallel code. Three choices make that possible:
- `layers` is a ModuleDict: a pipeline stage deletes the blocks it does not own and keeps the others' names, so a
  checkpoint's fully-qualified names are the same at every layout.
- The attention derives its head counts from the local weights (`view(b, t, -1, head_dim)`): under tensor
  parallelism a rank holds whole query and key/value heads, and the same forward runs on its share.
- `init_weights(seed)` makes every parameter from nothing, after `to_empty` from the meta device and on DTensors
  after `fully_shard`/`parallelize_module`, and gives the same numbers at every layout: each block of 64 rows of a
  parameter is drawn from a generator seeded by (seed, its name, the block), and each rank draws only the blocks
  its piece lies in. A sharded model costs each rank its share to initialise, not the whole model.
Its shape is config.py's `LlamaArgs`. Its state dict converts to and from Hugging Face's `LlamaForCausalLM` (`to_hf`,
`from_hf`): the same weights give the same logits (tests/recipe/test_llama_reference.py holds it against `transformers`).
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from config import LlamaArgs


def rope_tables(cfg: LlamaArgs, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, frequency), shapes (max_seq_len, head_dim / 2), float32. Pair i of a head
    turns by position x theta^(-2i / head_dim): fast turns for the first pairs, slow for the last. With Llama 3.1's
    `rope_scaling` the slow frequencies (wavelengths beyond the original context) are divided by `factor`, the fast
    ones kept, and those between blended (Hugging Face's `_compute_llama3_parameters`, in the same float32 steps)."""
    exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64, device=device).float() / cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** exponents)
    if cfg.rope_scaling:
        s = cfg.rope_scaling
        old = s["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / s["low_freq_factor"], old / s["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / s["factor"], inv_freq)
        smooth = (old / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
        blended = (1 - smooth) * scaled / s["factor"] + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, blended, scaled)
    angles = torch.outer(torch.arange(cfg.max_seq_len, device=device).float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each consecutive pair (x[2i], x[2i+1]) of every head by its position's angle: x is (batch, seq, heads,
    head_dim), cos and sin (seq, head_dim / 2), or (batch, seq, head_dim / 2) where each sequence's tokens have
    positions of their own (packed conversations, each from 0). Meta's and torchtitan's convention (interleaved pairs; Hugging Face
    pairs x[i] with x[i + head_dim/2] instead, and `to_hf` permutes wq and wk to match). In float32, as Meta's."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x1, x2 = pairs[..., 0], pairs[..., 1]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)         # the same angle for every head
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal self-attention with rotary positions and grouped-query attention: wk and wv make n_kv_heads heads,
    each repeated for its group of n_heads / n_kv_heads query heads (fewer key/value bytes to keep and to cache,
    the same attention otherwise). `mask`: packed sequences (Llama.forward's `positions`), a (batch, 1, seq, seq)
    boolean mask that keeps each token's attention inside its own sequence."""

    def __init__(self, cfg: LlamaArgs):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: all of them in one process, this rank's whole heads under tensor parallelism
        q, k, v = (w(x).view(b, t, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        cos, sin = cos[..., :t, :], sin[..., :t, :]         # the angles of these positions
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))    # (batch, heads, seq, head_dim)
        past = 0
        if cache is not None:                               # generation: the earlier tokens' keys and values
            past = cache.length
            k, v = cache.update(k, v)
        group = q.shape[1] // k.shape[1]                    # query heads per key/value head
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if mask is not None:                                # packed sequences: causal within each
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif past == 0 or t == 1:                           # all tokens new (training), or one new token
            y = F.scaled_dot_product_attention(q, k, v, is_causal=past == 0)
        else:                                               # several new tokens after cached ones
            mask = torch.ones(t, past + t, dtype=torch.bool, device=x.device).tril(past)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x). The gate (w1) decides per hidden unit how much of the value (w3) passes; with
    three matrices instead of two, Llama's hidden width is 2/3 of the classic 4 x dim, so it costs the same."""

    def __init__(self, cfg: LlamaArgs):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then x + feed_forward(norm(x))."""

    def __init__(self, cfg: LlamaArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, cache, mask=mask)
        return x + self.feed_forward(self.ffn_norm(x))



def block_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """The attention mask of sequences packed into rows, (batch, 1, seq, seq), True where a query may look: at its
    own and earlier tokens of its own sequence. A sequence begins wherever the position does not continue the one
    before (position 0 in a pack of whole conversations). SDPA takes it as is, tensor parallel too (each rank's
    heads); it costs seq x seq bytes per row, which FlexAttention's block mask would not."""
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    sequence = starts.cumsum(dim=1)                         # which sequence of the row each token belongs to
    causal = torch.ones(positions.shape[1], positions.shape[1], dtype=torch.bool, device=positions.device).tril()
    return ((sequence[:, :, None] == sequence[:, None, :]) & causal)[:, None]


class Llama(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab); the loss is computed outside. A pipeline stage sets the
    parts it does not own to None: the first stage takes token ids, the others hidden states. The rotary tables,
    buffers of the root passed to every block, are not saved in checkpoints (init_rope computes them). `positions`
    (batch, seq): several sequences packed in a row, each from position 0 (block_causal_mask keeps them apart)."""

    def __init__(self, cfg: LlamaArgs):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight          # one tensor, two uses
        for name, table in zip(("rope_cos", "rope_sin"), rope_tables(cfg)):
            self.register_buffer(name, table, persistent=False)

    def forward(self, tokens: torch.Tensor, cache=None, positions: torch.Tensor | None = None) -> torch.Tensor:
        start = 0 if cache is None else cache.length
        if start + tokens.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"{start + tokens.shape[1]} positions exceed max_seq_len {self.cfg.max_seq_len}")
        # from `start` on, whole: under sequence parallelism the attention cuts them once it has the whole sequence
        cos, sin, mask = self.rope_cos[start:], self.rope_sin[start:], None
        if positions is not None:          # packed sequences: each token's own angles, attention within its sequence
            cos, sin, mask = self.rope_cos[positions], self.rope_sin[positions], block_causal_mask(positions)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for name, block in self.layers.items():
            h = block(h, cos, sin, None if cache is None else cache.layer(int(name)), mask=mask)
        if cache is not None:
            cache.length += tokens.shape[1]
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Every parameter from nothing, the same numbers at every layout: normal(0, 0.02) for the embedding and
        the Linear weights, 0.02 / sqrt(2 * n_layers) for the two that write into the residual stream (`wo`, `w2`:
        GPT-2's scaling), ones for the RMSNorm weights; then the rotary tables. Parameters may be DTensors: each
        rank draws only the rows it holds (`fill_normal`)."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            name = name.replace("_orig_mod.", "")      # a torch.compile'd block's wrapper (apply_compile)
            if name.endswith("norm.weight"):
                (param.to_local() if hasattr(param, "to_local") else param).fill_(1.0)
            else:
                std = residual_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
                fill_normal(param, std, seed * 1_000_003 + zlib.crc32(name.encode()))
        self.init_rope()

    @torch.no_grad()
    def init_rope(self) -> None:
        """The rotary tables, on the buffers' device (after to_empty they hold garbage)."""
        for buffer, table in zip((self.rope_cos, self.rope_sin), rope_tables(self.cfg)):
            buffer.copy_(table)

    def to_empty(self, *, device, recurse: bool = True) -> "Llama":
        """Module.to_empty gives each module a parameter of its own: a tied output is tied to the embedding again."""
        super().to_empty(device=device, recurse=recurse)
        if self.cfg.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:   # (no pipeline: a tie)
            self.output.weight = self.tok_embeddings.weight
        return self


INIT_ROWS = 64     # rows drawn from one generator: the unit a rank draws whole, whatever piece of them it holds


def fill_normal(param: torch.Tensor, std: float, seed: int) -> None:
    """normal(0, std) into a parameter, the same numbers whatever piece of it this rank holds: the rows are drawn
    in blocks of INIT_ROWS, block b from a generator seeded by (seed, b), so a rank draws only the blocks its rows
    fall in, at full width, and keeps its piece: a piece cut along the rows (FSDP2's Shard(0), tensor parallel's
    column-wise) costs a rank its share, one cut along the columns (row-wise Shard(1)) every row of the tensor
    (tests/recipe/test_train_robust.py counts what each rank draws). Where the piece lies: `local_piece`."""
    offsets, sizes, local = local_piece(param)
    if local.numel() == 0:
        return
    start, stop = offsets[0], offsets[0] + sizes[0]
    first, last = start // INIT_ROWS * INIT_ROWS, min(param.shape[0], -(-stop // INIT_ROWS) * INIT_ROWS)
    rows = torch.empty(last - first, *param.shape[1:])
    for b in range(first, last, INIT_ROWS):              # each block from its own generator, in place
        block = torch.Generator().manual_seed(seed * 1_000_003 + b // INIT_ROWS)
        rows[b - first:b - first + INIT_ROWS].normal_(0.0, std, generator=block)
    local.copy_(rows[(slice(start - first, stop - first), *(slice(o, o + n) for o, n in zip(offsets[1:], sizes[1:])))])


def local_piece(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]:
    """(offsets, sizes, tensor) of the piece of `param` this rank holds: all of a plain tensor; of a DTensor, its
    local tensor and where it lies in the whole, from the placements and this rank's mesh coordinate by torch.chunk's
    rule (a mesh dimension of n ranks cuts what it is given into chunks of ceil(length / n), the last ones shorter
    or empty). A Shard cuts in mesh order; FSDP2 over tensor parallel marks its own cut of the same tensor dimension
    `_StridedShard(dim, split_factor)`: it cuts last, inside the later mesh dimensions' pieces (their sizes multiply
    to the factor). fill_normal draws, and checkpoint.py's load_hf reads, just that piece."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return (0,) * param.dim(), tuple(param.shape), param
    mesh, where, local = param.device_mesh, param.device_mesh.get_coordinate(), param.to_local()
    starts, lengths = [0] * param.dim(), list(param.shape)
    for dim in range(param.dim()):
        plain = [m for m, p in enumerate(param.placements) if p.is_shard(dim)]
        strided = [(m, p.split_factor) for m, p in enumerate(param.placements)
                   if not p.is_shard() and getattr(p, "dim", None) == dim and getattr(p, "split_factor", 1) > 1]
        for m, factor in strided:
            if factor != math.prod(mesh.size(k) for k in plain if k > m):
                raise ValueError(f"{param.placements}: a split factor {factor} this rule does not place")
        for m in plain + [m for m, _ in strided]:
            chunk = -(-lengths[dim] // mesh.size(m))
            start = min(where[m] * chunk, lengths[dim])
            starts[dim], lengths[dim] = starts[dim] + start, min(chunk, lengths[dim] - start)
    if tuple(lengths) != tuple(local.shape):
        raise ValueError(f"{param.placements} on a mesh of {tuple(mesh.shape)}: this rank's piece would be "
                         f"{tuple(lengths)}, its local tensor is {tuple(local.shape)}")
    return tuple(starts), tuple(lengths), local


class KVCache:
    """The keys and values of the tokens generated so far, per block, so each new token runs the model on itself
    alone (one process, inference). Holds n_kv_heads heads, not n_heads: grouped-query attention's saving."""

    def __init__(self, cfg: LlamaArgs, batch: int, max_len: int, device=None, dtype=torch.float32):
        if max_len > cfg.max_seq_len:
            raise ValueError(f"{max_len} tokens exceed the model's max_seq_len {cfg.max_seq_len}")
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k, self.v = torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0                              # tokens cached; the model's forward advances it

    def layer(self, index: int) -> "_LayerCache":
        return _LayerCache(self, index)


@dataclass
class _LayerCache:
    cache: KVCache
    index: int

    @property
    def length(self) -> int:
        return self.cache.length

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' keys and values (batch, kv_heads, new, head_dim); return every token's."""
        start, end = self.cache.length, self.cache.length + k.shape[2]
        if end > self.cache.k.shape[3]:
            raise ValueError(f"the cache holds {self.cache.k.shape[3]} tokens; {end} asked")
        self.cache.k[self.index, :, :, start:end] = k
        self.cache.v[self.index, :, :, start:end] = v
        return self.cache.k[self.index, :, :, :end], self.cache.v[self.index, :, :, :end]


IGNORE_INDEX = -100           # a target that is none (a prompt's token, padding): F.cross_entropy's default
LOSS_CHUNK_BYTES = 2 ** 28    # float32 bytes of logits the loss works on at a time: rows of 512 at vocab 131,072
# (larger chunks launch fewer kernels on a GPU; smaller ones hold less float32 at a time)


class ChunkedCrossEntropy(torch.autograd.Function):
    """The summed loss of rows of logits (tokens, vocab) against targets (tokens,), in float32 whatever the logits'
    dtype, `rows` at a time. Saved for backward: the logits as they are (bf16 under autocast), the targets and one
    float32 log-sum-exp per row. Backward recomputes each chunk's softmax in float32 and writes the gradient in the
    logits' dtype. F.cross_entropy on logits.float() holds all of them in float32 instead (the copy, the log-softmax
    it saves, then their gradients): at vocab 128k, 512 KiB per token for each float32 copy."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, rows: int) -> torch.Tensor:
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for start in range(0, logits.shape[0], rows):     # float32 from here on: bf16 - float32 promotes
            chunk = logits[start:start + rows]
            top = chunk.amax(dim=-1, keepdim=True).float()
            lse[start:start + rows] = torch.sub(chunk, top).exp_().sum(dim=-1).log_() + top.squeeze(1)
        counted = targets != IGNORE_INDEX
        picked = logits.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1).float()   # each target's logit
        ctx.save_for_backward(logits, targets, lse)
        ctx.rows = rows
        return torch.where(counted, lse - picked, 0.0).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        weight = torch.where(targets != IGNORE_INDEX, grad, 0.0)     # d loss / d row's loss: 0 for no target
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.rows):
            end = start + ctx.rows
            p = torch.sub(logits[start:end], lse[start:end, None]).exp_()          # the softmax, float32
            p.scatter_add_(1, targets[start:end].clamp(min=0)[:, None], p.new_full((len(p), 1), -1.0))  # - one-hot
            grad_logits[start:end] = p.mul_(weight[start:end, None])               # cast to the logits' dtype
            del p                                      # freed before the next chunk's: one chunk alive at a time
        return grad_logits, None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token loss of logits (batch, seq, vocab) against targets (batch, seq), in float32 (a bf16 softmax would
    lose the loss's low bits). Targets equal to IGNORE_INDEX count for nothing; "mean" divides by the targets that
    count, "sum" does not (to average over several micro-batches' targets). Chunked (ChunkedCrossEntropy) rather
    than an output projection fused with the loss: the model still returns logits, which generation, the pipeline's
    stages and the tests read. Under tensor parallel's loss_parallel the logits are a DTensor split over the
    vocabulary, which the chunks cannot take: there F.cross_entropy, whose parallel form holds each rank's share."""
    from torch.distributed.tensor import DTensor

    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction {reduction!r}: mean or sum")
    flat, targets = logits.flatten(0, 1), targets.flatten()
    if isinstance(logits, DTensor):
        return F.cross_entropy(flat.float(), targets, ignore_index=IGNORE_INDEX, reduction=reduction)
    total = ChunkedCrossEntropy.apply(flat, targets, max(1, LOSS_CHUNK_BYTES // (4 * flat.shape[-1])))
    return total if reduction == "sum" else total / (targets != IGNORE_INDEX).sum()


# ------------------------------------------------------------------------------------ Hugging Face's Llama, both ways
_HF_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_HF_BLOCK = {"attention_norm": "input_layernorm", "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
             "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj"}


def hf_name(name: str) -> str:
    """Our parameter name -> `LlamaForCausalLM`'s (`layers.3.attention.wq.weight` -> `model.layers.3.self_attn.
    q_proj.weight`)."""
    if name in _HF_TOP:
        return _HF_TOP[name]
    _, index, rest = name.split(".", 2)
    module, _, leaf = rest.rpartition(".")
    return f"model.layers.{index}.{_HF_BLOCK[module]}.{leaf}"


def has_rotary_rows(name: str) -> bool:
    """wq and wk: their output rows carry rotary pairs, head_dim rows per head, which `to_hf` reorders."""
    return name.endswith(("attention.wq.weight", "attention.wk.weight"))


def to_hf(name: str, tensor: torch.Tensor, cfg: LlamaArgs) -> tuple[str, torch.Tensor]:
    """One of our weights as Hugging Face stores it: its name, and for wq and wk the rows of each head reordered
    from interleaved pairs (x[2i], x[2i+1]) to halves (x[i], x[i + head_dim/2]), as Meta's conversion script does.
    Rows move only within their head: the rows of some whole heads convert alone as they do in the whole tensor."""
    if has_rotary_rows(name):
        (rows, cols), half = tensor.shape, cfg.head_dim // 2
        tensor = tensor.reshape(rows // cfg.head_dim, half, 2, cols).transpose(1, 2).reshape(rows, cols)
    return hf_name(name), tensor


def from_hf(name: str, tensor: torch.Tensor, cfg: LlamaArgs) -> torch.Tensor:
    """Hugging Face's tensor for our parameter `name` (found under `hf_name(name)`), or the rows of some whole heads
    of it, back in our layout: `to_hf`'s reordering undone."""
    if has_rotary_rows(name):
        (rows, cols), half = tensor.shape, cfg.head_dim // 2
        tensor = tensor.reshape(rows // cfg.head_dim, 2, half, cols).transpose(1, 2).reshape(rows, cols)
    return tensor
