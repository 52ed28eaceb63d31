# From the PyTorch distributed cookbook: the cells tagged 'script:train/model.py' in
#   notebooks/03_fsdp_and_device_mesh.ipynb
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
"""The GPT every part of the recipe trains: a decoder-only transformer on bytes, in torchtitan's module names.

Why it looks like this: parallelism is applied to this unchanged model by the functions in parallelize.py, so the
model holds no parallel code. Three choices make that possible:
- `layers` is a ModuleDict: a pipeline stage deletes the blocks it does not own and keeps the others' names, so a
  checkpoint's fully-qualified names are the same at every layout.
- The attention derives its head count from the local weight (`view(b, t, -1, head_dim)`): under tensor
  parallelism a rank holds whole heads, and the same forward runs on its share.
- `init_weights(seed)` makes every parameter from nothing, after `to_empty` from the meta device and on DTensors
  after `fully_shard`/`parallelize_module`, and gives the same numbers at every layout: each parameter is drawn in
  full from a generator seeded by (seed, its name), and each rank keeps its own piece. A rank so holds, for a moment,
  one whole parameter (the largest: vocab x dim or dim x hidden), never the whole model.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab_size: int = 256      # byte-level tokens
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    max_seq_len: int = 1024
    mlp_ratio: int = 4         # hidden = mlp_ratio * dim
    norm_eps: float = 1e-5

    @property
    def hidden(self) -> int:
        return self.mlp_ratio * self.dim

    def num_params(self) -> int:
        """P = V*D + S*D + L*(4*D^2 + 2*D*H + 2*D) + D + D*V (the formula the memory planner uses)."""
        v, d, s, n, h = self.vocab_size, self.dim, self.max_seq_len, self.n_layers, self.hidden
        return v * d + s * d + n * (4 * d * d + 2 * d * h + 2 * d) + d + d * v

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward and backward, 3 x the forward's 2 FLOPs per multiply-add): 6 per weight
        of every matmul (the embedding lookups are no matmuls) plus the attention scores and their use,
        12 * layers * dim * seq_len (PaLM's appendix B; causal masking is not discounted, as there)."""
        d, n, h, v = self.dim, self.n_layers, self.hidden, self.vocab_size
        matmul_weights = n * (4 * d * d + 2 * d * h) + d * v
        return 6 * matmul_weights + 12 * n * d * seq_len


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.dim % cfg.n_heads:
            raise ValueError(f"dim {cfg.dim} is not divisible by n_heads {cfg.n_heads}")
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(cfg.dim, cfg.dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: all of them in one process, this rank's whole heads under tensor parallelism
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then x + feed_forward(norm(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab); the loss is computed outside. A pipeline stage sets the
    parts it does not own to None: the first stage takes token ids, the others hidden states."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = tokens
        if self.tok_embeddings is not None:
            # positions as (1, seq): under tensor parallelism both lookups come out sharded along dim 1 alike
            positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
            h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for block in self.layers.values():
            h = block(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Every parameter from nothing, the same numbers at every layout: normal(0, 0.02) for the embeddings and
        the Linear weights, 0.02 / sqrt(2 * n_layers) for the two that write into the residual stream (`wo`, `w2`:
        GPT-2's scaling), ones for the RMSNorm weights. Parameters may be DTensors (sharded, replicated)."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            name = name.replace("_orig_mod.", "")      # a torch.compile'd block's wrapper (apply_compile)
            if name.endswith("norm.weight"):
                full = torch.ones(param.shape)
            else:
                std = residual_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
                generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                full = torch.empty(param.shape).normal_(0.0, std, generator=generator)
            _copy_full_into(param, full)


def _copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write a whole tensor into a parameter that may hold only this rank's piece of it (a DTensor)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        # src_data_rank=None: every rank has `full` already, so each slices out its own piece, no communication
        piece = distribute_tensor(full.to(param.device, param.dtype), param.device_mesh, param.placements,
                                  src_data_rank=None)
        param.to_local().copy_(piece.to_local())
    else:
        param.copy_(full)
