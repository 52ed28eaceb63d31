# From the PyTorch distributed cookbook: the cells tagged 'script:train/ac.py' in
#   notebooks/05_mixed_precision.ipynb
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
"""Activation checkpointing and torch.compile per block: memory traded for recomputation, and the blocks' own
code fused into fewer kernels. Applied after tensor parallelism and before FSDP2 (parallelize.py).
"""
import functools

import torch
from torch import nn


def apply_compile(model: nn.Module, backend="inductor") -> None:
    """torch.compile each block (as torchtitan does: the blocks are alike, so one compiled graph serves them all),
    before FSDP2, so its hooks stay outside the compiled graphs. The compiled block is a wrapper whose parameter
    names gain `_orig_mod.`; get_state_dict (and so every checkpoint) and init_weights drop it. `backend`: any
    torch.compile backend (notebook 07 passes one that counts the graphs it is handed)."""
    for name, block in model.layers.named_children():
        model.layers.register_module(name, torch.compile(block, fullgraph=True, backend=backend))


def _selective_policy():
    """Per-op selective checkpointing: keep the outputs of the matmuls and of attention (costly to recompute),
    recompute the rest (norms, rotations, SiLU, the gate's product, adds: cheap, and their outputs are as large).
    Ops that run with autograd off, inside a custom autograd.Function's forward (cp.py's ring attention, notebook
    08b), are recomputed: keeping its chunk x chunk score blocks would cost memory quadratic in the sequence."""
    from torch.ops import aten  # not torch.ops.aten: cloudpickle (notebook 05's workers) cannot pickle torch.ops
    from torch.utils.checkpoint import CheckpointPolicy

    save = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.linear.default,
            aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_attention_math.default}
    for name in ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        if hasattr(aten, name):
            save.add(getattr(aten, name).default)

    def policy(ctx, op, *args, **kwargs):
        keep = op in save and torch.is_grad_enabled()
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def apply_ac(model: nn.Module, mode: str) -> None:
    """Activation checkpointing per block: "full" keeps only each block's input and recomputes the block in the
    backward; "selective" keeps the matmuls' and attention's outputs and recomputes the rest (per op, through
    torch.utils.checkpoint's create_selective_checkpoint_contexts); "alternate" checkpoints every other block
    whole. The block's forward is wrapped in place (not the module), so parameter names do not change."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    if mode == "none":
        return
    if mode not in ("full", "selective", "alternate"):
        raise ValueError(f"activation checkpointing mode {mode!r}: use none, full, selective or alternate")
    context_fn = None
    if mode == "selective":
        context_fn = functools.partial(create_selective_checkpoint_contexts, _selective_policy())
    for name, block in model.layers.items():
        if mode == "alternate" and int(name) % 2:
            continue
        block.forward = _checkpointed(block.forward, checkpoint, context_fn)


def _checkpointed(forward, checkpoint, context_fn):
    """forward run under torch.utils.checkpoint. A function of our own, not functools.partial(checkpoint, ...):
    torch.compile skips frames of torch's own files, so the compiled block must enter through code of ours, where
    it sees the checkpoint call and traces it."""
    options = {"context_fn": context_fn} if context_fn else {}

    def checkpointed_forward(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **options, **kwargs)
    return checkpointed_forward
