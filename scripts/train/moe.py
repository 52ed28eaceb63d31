# From the PyTorch distributed cookbook: the cells tagged 'script:train/moe.py' in
#   notebooks/08b_context_and_expert_parallel.ipynb
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
"""Mixture of experts: a feed-forward made of many SwiGLU experts, of which a router picks top_k per token, and
expert parallelism, the experts shared out across ranks with the tokens sent to them and back by all-to-all.

    apply_moe(model, n_experts=8, top_k=2)   # each block's feed_forward becomes an MoE (before to_empty/init)
    apply_ep(model, ep_mesh)                 # each rank keeps n_experts / ep of them; tokens travel by all-to-all
    loss = cross_entropy(model(x), y) + aux_weight * moe_aux_loss(model)
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class GroupedLinear(nn.Module):
    """One Linear weight per expert, stacked: (n_experts, out_features, in_features). Stacked, so that expert
    parallelism shards the experts as one tensor (Shard(0)); named `weight`, so that the model's init_weights
    draws it as it draws a Linear's (w2 with the residual branch's smaller std)."""

    def __init__(self, n_experts: int, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, out_features, in_features))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's piece on this rank (under expert parallelism: this rank's experts), a tensor as is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def run_experts(experts: nn.ModuleDict, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """SwiGLU of each local expert on its rows of x (sorted by expert: counts[e] rows for expert e). The weights
    in x's dtype: experts that FSDP2 leaves alone keep float32 while its bf16 policy hands them bf16 rows."""
    w1, w3, w2 = (_local(experts[name].weight).to(x.dtype) for name in ("w1", "w3", "w2"))

    return torch.cat([(F.silu(part @ w1[e].T) * (part @ w3[e].T)) @ w2[e].T for e, part in enumerate(x.split(counts))])


class MoE(nn.Module):
    """Top-k routed SwiGLU experts in place of the block's feed-forward, dropless: every token reaches its k experts
    (no capacity limit, so nothing is dropped and the result does not depend on the batch's other tokens). The
    router's softmax probabilities of the k chosen experts, renormalized to sum to 1, weight their outputs (Mixtral).
    After each forward, `aux_loss` holds Switch Transformer's load-balancing loss, n_experts x sum over experts of
    (share of the assignments it got) x (its mean router probability): 1 when the load is even, at most
    n_experts / top_k (a token's k choices are k different experts, so a share is at most 1/k, and the mean
    probabilities sum to 1), approached when every token gives nearly all its probability to the same k experts.
    Add it to the loss (`moe_aux_loss`: until a backward uses it, it keeps the router's graph alive);
    `tokens_per_expert` holds the assignments each expert got."""

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k {top_k} must be between 1 and n_experts {n_experts}")
        self.n_experts, self.top_k = n_experts, top_k
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleDict({"w1": GroupedLinear(n_experts, dim, hidden),
                                      "w3": GroupedLinear(n_experts, dim, hidden),
                                      "w2": GroupedLinear(n_experts, hidden, dim)})
        self.ep_group = None               # apply_ep sets it
        self.aux_loss = self.tokens_per_expert = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, x = x.shape, x.reshape(-1, x.shape[-1])
        logits = self.router(x)                  # scores in float32 at least: bf16 would round them
        probs = logits.softmax(dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))   # (tokens, n_experts)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        counts = torch.bincount(chosen.flatten(), minlength=self.n_experts)
        self.aux_loss = self.n_experts * (counts / counts.sum() * probs.mean(dim=0)).sum()
        self.tokens_per_expert = counts
        order = chosen.flatten().argsort(stable=True)    # the (token, choice) pairs grouped by expert
        token = order // self.top_k
        routed = x[token]
        if self.ep_group is None:
            out = run_experts(self.experts, routed, counts.tolist())
        else:
            out = expert_parallel(self.experts, routed, counts, self.ep_group)
        y = torch.zeros_like(x).index_add_(0, token, out * weights.flatten()[order].unsqueeze(-1))
        return y.view(shape)


class AllToAll(torch.autograd.Function):
    """all_to_all_single with its gradient: rows x[sum(send[:r]) : sum(send[:r+1])] go to rank r, and recv[r] rows
    come from it. The backward sends each row's gradient back where the row came from: the same call with the
    two splits swapped."""

    @staticmethod
    def forward(ctx, x, recv: list[int], send: list[int], group):
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


def expert_parallel(experts: nn.ModuleDict, routed: torch.Tensor, counts: torch.Tensor, group) -> torch.Tensor:
    """The routed rows (sorted by expert, counts[e] for each of all n_experts) through experts that live on other
    ranks: rank r holds experts r·E/N ... (r+1)·E/N - 1. Three all-to-alls: how many rows each rank will get for
    each of its experts (the counts), the rows (dispatch), and the outputs back (combine)."""
    world = dist.get_world_size(group)
    local = counts.numel() // world
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)           # [source rank, my expert] -> rows
    recv_counts = recv_counts.view(world, local)
    send, recv = counts.view(world, local).sum(1).tolist(), recv_counts.sum(1).tolist()
    received = AllToAll.apply(routed, recv, send, group)               # grouped by source rank, then expert
    expert_of_row = torch.arange(local, device=routed.device).repeat(world).repeat_interleave(recv_counts.flatten())
    by_expert = expert_of_row.argsort(stable=True)                     # regrouped by expert, then source rank
    out = run_experts(experts, received[by_expert], recv_counts.sum(0).tolist())[by_expert.argsort()]
    return AllToAll.apply(out, send, recv, group)                      # combine: each row back to its token's rank


def apply_moe(model: nn.Module, n_experts: int, top_k: int, hidden: int | None = None) -> None:
    """Replace each block's feed_forward by an MoE of n_experts SwiGLU experts, top_k per token, each as wide as the
    dense feed-forward unless `hidden` says (fine-grained experts are narrower). Call it where the model is still
    unmaterialized (meta) or before init_weights, like the other apply_* functions."""
    cfg = model.cfg
    for block in model.layers.values():
        device = block.feed_forward.w1.weight.device
        with torch.device(device):
            block.feed_forward = MoE(cfg.dim, hidden or cfg.hidden, n_experts, top_k)


def apply_ep(model: nn.Module, ep_mesh) -> None:
    """Expert parallelism over ep_mesh for every MoE in `model` (or `model` itself): its expert weights become
    DTensors sharded over the experts (Shard(0)), so init_weights and checkpoints see the whole tensors, and it
    sends its tokens to their experts' ranks (expert_parallel)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for moe in [m for m in model.modules() if isinstance(m, MoE)]:
        if moe.n_experts % ep_mesh.size():
            raise ValueError(f"ep {ep_mesh.size()} must divide the {moe.n_experts} experts")
        for linear in moe.experts.values():
            linear.weight = nn.Parameter(distribute_tensor(linear.weight.data, ep_mesh, [Shard(0)], src_data_rank=None))
        moe.ep_group = ep_mesh.get_group()


def moe_aux_loss(model: nn.Module) -> torch.Tensor:
    """The load-balancing losses of the last forward, summed over the MoE blocks (zero without MoE)."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoE) and m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else torch.zeros(())
