# From the PyTorch distributed cookbook: the cells tagged 'script:train/tp.py' in
#   notebooks/07_tensor_parallel_and_2d.ipynb
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
"""Megatron-style tensor parallelism of the model, with sequence parallel and a parallel loss."""
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool = True, sequence_parallel: bool = True) -> None:
    """Megatron-style tensor parallel: wq/wk/wv, w1 and w3 split by output features (ColwiseParallel: each rank
    whole query and key/value heads, a slice of the hidden units), wo and w2 by input features (RowwiseParallel) so
    each block needs one reduction per half; the embedding and the output layer split over the vocabulary (a tied
    output shares the embedding's shards). With `sequence_parallel` the residual stream between the blocks is
    split along the sequence (Shard(1)) and the norms work on their piece (SequenceParallel): each all-reduce
    becomes a reduce-scatter, and an all-gather where the whole sequence is needed. With `loss_parallel` the logits
    stay split over the vocabulary and the loss must run inside `torch.distributed.tensor.parallel.loss_parallel()`
    (see train.py)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    between = Shard(1) if sequence_parallel else Replicate()      # the residual stream between the split layers
    top = {"norm": SequenceParallel(),
           "output": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                     use_local_output=not loss_parallel)}
    if model.tok_embeddings is not None:
        # each rank looks up its rows of the table; the sum of the pieces is reduced (with SP: scattered along the
        # sequence, a reduce-scatter)
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if model.norm is None or not sequence_parallel:
        top.pop("norm")
    if model.norm is None:
        top.pop("output")
    parallelize_module(model, tp_mesh, top)
    if model.cfg.tie_embeddings:          # both are Shard(0) over the vocabulary: one parameter again
        model.output.weight = model.tok_embeddings.weight
    # the input as one DTensor per attention and feed-forward (all-gathered from the sequence shards with SP): wq,
    # wk and wv then add their partial input gradients before a single reduction, as Megatron's fused qkv does.
    # The attention's other inputs (the rotary tables, a cache) are plain tensors, left as they are (None).
    to_whole = (between,), (Replicate(),)
    norms = {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()} if sequence_parallel else {}
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            **norms,
            "attention": PrepareModuleInput(input_layouts=(between, None, None, None),
                                            desired_input_layouts=(Replicate(), None, None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=between),
            "feed_forward": PrepareModuleInput(input_layouts=to_whole[0], desired_input_layouts=to_whole[1]),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=between),
        })
