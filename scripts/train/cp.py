# From the PyTorch distributed cookbook: the cells tagged 'script:train/cp.py' in
#   notebooks/08b_context_and_expert_parallel.ipynb
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
"""Context parallelism: the sequence split across ranks, attention computed as a ring (each rank keeps its queries,
the keys and values travel from rank to rank), causal work balanced by giving rank i the chunks i and 2N-1-i.

    apply_cp(model, cp_mesh)                  # each block's attention becomes ring attention over cp_mesh
    x, y = (cp_shard(t, cp_mesh) for t in (x, y))   # this rank's tokens (and the rotary positions follow them)

The gradients of the non-attention weights are partial on each rank (its tokens only): average them over cp_mesh
as over data-parallel replicas (FSDP2 over a mesh that includes the cp ranks does it in its reduce-scatter).
"""
import math

import torch
import torch.distributed as dist
from torch import nn

from model import apply_rotary


def cp_chunks(rank: int, world: int, balanced: bool = True) -> tuple[int, int]:
    """The two chunks, of 2 x world equal chunks of the sequence, that `rank` holds: i and 2·world - 1 - i when
    balanced (under a causal mask every rank then has the same work), 2i and 2i + 1 when not."""
    return (rank, 2 * world - 1 - rank) if balanced else (2 * rank, 2 * rank + 1)


def cp_positions(seq_len: int, rank: int, world: int, balanced: bool = True) -> torch.Tensor:
    """The positions in the sequence of this rank's tokens (its two chunks, in order)."""
    if seq_len % (2 * world):
        raise ValueError(f"context parallel over {world} ranks cuts the sequence into {2 * world} equal chunks: "
                         f"{seq_len} tokens do not divide")
    c = seq_len // (2 * world)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in cp_chunks(rank, world, balanced)])


def cp_shard(t: torch.Tensor, cp_mesh, dim: int = 1, balanced: bool = True) -> torch.Tensor:
    """This rank's tokens of a (batch, seq, ...) tensor: inputs, targets."""
    positions = cp_positions(t.shape[dim], cp_mesh.get_local_rank(), cp_mesh.size(), balanced)
    return t.index_select(dim, positions.to(t.device))


def scores(q, k, scale: float, diagonal: bool) -> torch.Tensor:
    """q·kᵀ/√d of a query chunk against a key chunk. `diagonal`: the chunk is the queries' own, and the causal mask
    hides each query's later keys (-inf: exp gives 0)."""
    s = (q @ k.transpose(-2, -1)) * scale
    if diagonal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def attend(q, k, v, scale: float, diagonal: bool):
    """Softmax attention of a query chunk over one key/value chunk, normalized within that chunk: the output and
    the log-sum-exp of each query's scores, max + log(sum(exp(score - max))) (the max keeps exp from overflowing)."""
    s = scores(q, k, scale, diagonal)
    top = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - top)
    total = p.sum(dim=-1, keepdim=True)
    return (p @ v) / total, (top + total.log()).squeeze(-1)


def merge(out, lse, block_out, block_lse):
    """The online softmax: two outputs each normalized over its own keys become the output over both, weighted by
    each part's share of the total exp-sum, exp(lse_part - lse_both)."""
    both = torch.logaddexp(lse, block_lse)
    return (out * torch.exp(lse - both).unsqueeze(-1) + block_out * torch.exp(block_lse - both).unsqueeze(-1),
            both)


def start_shift(buffers, group):
    """Send `buffers` (a tensor, or a list of them) to the next rank of the ring and receive the previous rank's,
    without waiting: returns what is being received (shaped alike) and the works to wait on (the compute of this
    step overlaps the transfer)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    sent = list(buffers) if isinstance(buffers, (list, tuple)) else [buffers]
    received = [torch.empty_like(b) for b in sent]
    after, before = dist.get_global_rank(group, (rank + 1) % world), dist.get_global_rank(group, (rank - 1) % world)
    ops = [op for s, r in zip(sent, received)
           for op in (dist.P2POp(dist.isend, s, after, group), dist.P2POp(dist.irecv, r, before, group))]
    return (received if isinstance(buffers, (list, tuple)) else received[0]), dist.batch_isend_irecv(ops)


def finish_shift(pending) -> torch.Tensor:
    received, works = pending
    for work in works:
        work.wait()
    return received


def visible_blocks(mine, theirs):
    """The (query chunk, key chunk) pairs a causal mask leaves anything of: earlier chunks whole, the own one
    below its diagonal, later chunks not at all."""
    return [(i, j, kj == qi) for i, qi in enumerate(mine) for j, kj in enumerate(theirs) if kj <= qi]


def _heads(t, group_size: int):
    return t.repeat_interleave(group_size, dim=1)       # grouped-query attention: each key/value head serves a group


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the whole sequence, q (batch, heads, tokens, head_dim) and k, v
    (batch, kv_heads, tokens, head_dim) holding this rank's two chunks (cp_chunks). Forward: N steps; at each the
    rank attends to the key/value block it holds and passes it on around the ring, the partial outputs merged by
    the online softmax. Backward: the blocks go round again, each with the gradient of its keys and values
    accumulating as it travels, until a last shift brings it home. Saves only q, k, v, the output and the
    log-sum-exp (flash attention's choice): no (tokens x tokens) scores are kept. As flash attention, it keeps the
    scores, the running output and log-sum-exp and the gradient sums in float32 (or `stats`; float64 inputs stay
    float64) whatever the inputs' dtype, and casts back at the end; keys and values travel in their own dtype."""

    @staticmethod
    def forward(ctx, q, k, v, group, balanced, stats=None):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        mine, scale, g = cp_chunks(rank, world, balanced), 1.0 / math.sqrt(q.shape[-1]), q.shape[1] // k.shape[1]
        acc = stats or torch.promote_types(q.dtype, torch.float32)
        qs, out, lse = q.to(acc).chunk(2, dim=2), [None, None], [None, None]
        kv = torch.stack([k, v])
        for step in range(world):
            pending = start_shift(kv, group) if step < world - 1 else None
            ks, vs = _heads(kv[0].to(acc), g).chunk(2, dim=2), _heads(kv[1].to(acc), g).chunk(2, dim=2)
            for i, j, diagonal in visible_blocks(mine, cp_chunks((rank - step) % world, world, balanced)):
                o, l = attend(qs[i], ks[j], vs[j], scale, diagonal)
                out[i], lse[i] = (o, l) if out[i] is None else merge(out[i], lse[i], o, l)
            if pending is not None:
                kv = finish_shift(pending)
        out, lse = torch.cat(out, dim=2).to(q.dtype), torch.cat(lse, dim=2)     # lse stays in `acc`
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.balanced, ctx.acc = group, balanced, acc
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, balanced, acc = ctx.group, ctx.balanced, ctx.acc
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        mine, scale, g = cp_chunks(rank, world, balanced), 1.0 / math.sqrt(q.shape[-1]), q.shape[1] // k.shape[1]
        dout = dout.to(acc)
        delta = (dout * out.to(acc)).sum(-1)            # softmax's backward: sum_j p_ij dp_ij, per query
        qs, dos, lses, deltas = (t.chunk(2, dim=2) for t in (q.to(acc), dout, lse, delta))
        dq = [torch.zeros_like(c) for c in qs]
        kv, dkv = torch.stack([k, v]), torch.zeros(2, *k.shape, dtype=acc, device=k.device)
        for step in range(world):
            kh, vh = _heads(kv[0].to(acc), g), _heads(kv[1].to(acc), g)
            dkh, dvh = torch.zeros_like(kh), torch.zeros_like(vh)
            ks, vs, dk, dv = (t.chunk(2, dim=2) for t in (kh, vh, dkh, dvh))
            for i, j, diagonal in visible_blocks(mine, cp_chunks((rank - step) % world, world, balanced)):
                p = torch.exp(scores(qs[i], ks[j], scale, diagonal) - lses[i].unsqueeze(-1))   # from the saved lse
                dv[j].add_(p.transpose(-2, -1) @ dos[i])
                ds = p * (dos[i] @ vs[j].transpose(-2, -1) - deltas[i].unsqueeze(-1))
                dq[i].add_(ds @ ks[j] * scale)
                dk[j].add_(ds.transpose(-2, -1) @ qs[i] * scale)
            dkv += torch.stack([d.unflatten(1, (-1, g)).sum(2) for d in (dkh, dvh)])   # back to kv_heads
            # the block's gradient travels with it, in `acc`; after `world` shifts it is home with its owner
            if step < world - 1:
                kv, dkv = finish_shift(start_shift([kv, dkv], group))
            elif world > 1:
                dkv = finish_shift(start_shift(dkv, group))
        return torch.cat(dq, dim=2).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


class ContextParallelAttention(nn.Module):
    """The model's Attention with ring attention in place of scaled_dot_product_attention. It takes over the same
    wq, wk, wv and wo (the parameter names do not change) and passes keys and values around the ring at n_kv_heads
    heads (grouped-query attention's saving, on the wire too)."""

    def __init__(self, attention: nn.Module, group, balanced: bool = True):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = attention.wq, attention.wk, attention.wv, attention.wo
        self.head_dim, self.group, self.balanced = attention.head_dim, group, balanced

    def forward(self, x, cos, sin, cache=None, mask=None):
        if cache is not None:
            raise ValueError("context parallelism splits training sequences; generation runs in one process")
        if mask is not None:
            raise ValueError("the ring attends causally over one sequence; packed sequences (a mask) are not built")
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rotary(q, cos[:t], sin[:t]), apply_rotary(k, cos[:t], sin[:t])    # this rank's positions
        y = RingAttention.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.group, self.balanced)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


def apply_cp(model: nn.Module, cp_mesh, balanced: bool = True) -> None:
    """Context parallelism over `cp_mesh`: each block's attention becomes ring attention, and during each forward
    the rotary tables hold this rank's positions (the root's forward reads positions 0..tokens-1 of them, so they
    are gathered at cp_positions for that forward and restored after: init_weights and checkpoints see the whole
    tables). Feed each rank `cp_shard` of the inputs and targets."""
    group, rank, world = cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size()
    for block in model.layers.values():
        block.attention = ContextParallelAttention(block.attention, group, balanced)

    def to_my_positions(root, args):
        positions = cp_positions(args[0].shape[1] * world, rank, world, balanced).to(root.rope_cos.device)
        root._whole_rope = root.rope_cos, root.rope_sin
        root.rope_cos, root.rope_sin = root.rope_cos[positions], root.rope_sin[positions]

    def restore(root, args, output):
        root.rope_cos, root.rope_sin = root._whole_rope
        del root._whole_rope

    model.register_forward_pre_hook(to_my_positions)
    model.register_forward_hook(restore, always_call=True)
