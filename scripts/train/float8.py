# From the PyTorch distributed cookbook: the cells tagged 'script:train/float8.py' in
#   notebooks/05_mixed_precision.ipynb
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
"""float8 training with torchao: each block's linear layers multiply in float8 (e4m3: 4 exponent bits, 3 mantissa
bits), each operand first multiplied by a scale that makes its largest value fill float8's range. The weights stay
in high precision (the optimizer's fp32 master weights, and what a checkpoint holds), cast to float8 at every use.

    names = apply_float8(model, "tensorwise", shards=True, emulate=False)   # meta model, before TP and FSDP2
    ...; optimizer.step(); precompute_scales(model)    # tensorwise with FSDP2: every weight's scale, one all-reduce

tensorwise: one scale per tensor. Under FSDP2 each weight is cast to float8 before its all-gather (torchao's float8
all-gather: 1 byte per element on the wire instead of bf16's 2), and `precompute_scales` takes all the weights'
scales after the optimizer step in one all-reduce instead of one per weight. rowwise: a scale per row, so an
outlier spoils only its row (more accurate, a little slower); its weights are gathered in high precision (torchao's
float8 all-gather takes one scale per tensor). `emulate=True` runs the same casts and scales with the matmul done
in high precision on the float8 values: on CPU ranks, where the suite tests it. torchao is imported inside the
functions below, so only a run that asks for float8 needs it installed.
"""
RECIPES = ("tensorwise", "rowwise")
# Each block's linear layers, and how tensor parallel (tp.py) splits them: "col" by output features, "row" by input
BLOCK_LINEARS = {"attention.wq": "col", "attention.wk": "col", "attention.wv": "col", "attention.wo": "row",
                 "feed_forward.w1": "col", "feed_forward.w3": "col", "feed_forward.w2": "row"}
MULTIPLE = 16     # float8 matmuls (torch._scaled_mm) take a weight whose two dimensions are multiples of 16
# Float8 tensor cores: NVIDIA compute capability 8.9 (Ada: L4, L40S) and up (Hopper, Blackwell); AMD gfx942 (MI300)
FLOAT8_CAPABILITY = {"cuda": (8, 9), "rocm": (9, 4)}


def block_linear_shapes(cfg, tp: int = 1) -> dict[str, tuple[int, int]]:
    """(out, in) of each block linear's weight as one rank multiplies it: its tensor-parallel piece."""
    d, h, q, kv = cfg.dim, cfg.hidden, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    whole = {"attention.wq": (q, d), "attention.wk": (kv, d), "attention.wv": (kv, d), "attention.wo": (d, q),
             "feed_forward.w1": (h, d), "feed_forward.w3": (h, d), "feed_forward.w2": (d, h)}
    return {n: (out // tp, inp) if BLOCK_LINEARS[n] == "col" else (out, inp // tp) for n, (out, inp) in whole.items()}


def float8_linear_names(cfg, tp: int = 1) -> list[str]:
    """The block linears that run in float8: those whose piece on a rank float8 matmuls accept. The rest, the
    output layer (its logits feed the loss: kept in high precision, as torchtitan keeps it) and the embedding (a
    lookup, no matmul) stay in the training dtype."""
    return [n for n, (out, inp) in block_linear_shapes(cfg, tp).items() if out % MULTIPLE == 0 and inp % MULTIPLE == 0]


def float8_flop_share(cfg, seq_len: int, tp: int = 1) -> float:
    """The share of a step's training FLOPs (config.flops_per_token) that the float8 linears do: 6 per weight of
    theirs per token. The rest (the output layer, the attention's scores, any linear left out) runs in the training
    dtype. What MFU counts against the float8 peak (`mixed_peak`)."""
    return 6 * float8_weights(cfg, tp) / cfg.flops_per_token(seq_len)


def float8_weights(cfg, tp: int = 1) -> int:
    """Elements of the model's float8 weights (all blocks, whole): what tensorwise gathers in 1 byte each under
    FSDP2 instead of the training dtype's 2 (bf16) or 4, in each all-gather (forward, and backward again where the
    weights were freed); the scales are not gathered (every rank computes the same). Gradients are reduced as
    before: float8 changes no reduce-scatter."""
    shapes = block_linear_shapes(cfg, tp)
    return cfg.n_layers * tp * sum(shapes[n][0] * shapes[n][1] for n in float8_linear_names(cfg, tp))


def mixed_peak(float8_share: float, float8_peak: float, other_peak: float) -> float:
    """The peak FLOP/s a step reaches at best when `float8_share` of its FLOPs run at the float8 peak and the rest
    at the other (the training dtype's): its FLOPs over the time each part takes at its own peak."""
    return 1.0 / (float8_share / float8_peak + (1.0 - float8_share) / other_peak)


def float8_datasheet_peak(device_name: str, other_dtype: str, float8_share: float) -> tuple[float, str] | None:
    """(the peak a float8 step's MFU is measured against, its source): `float8_share` of the FLOPs at the device's
    dense float8 datasheet peak, the rest at `other_dtype`'s (hardware.py's table); None where a row lacks either."""
    import hardware

    float8, other = hardware.datasheet_peak(device_name, "float8"), hardware.datasheet_peak(device_name, other_dtype)
    if float8 is None or other is None:
        return None
    return mixed_peak(float8_share, float8[0], other[0]), (f"{float8_share:.0%} of the FLOPs (the float8 linears') "
                                                           f"at the float8 datasheet peak, the rest at {other_dtype}'s "
                                                           f"({float8[1]})")


def check_float8_device(name: str, capability: tuple[int, int], rocm: bool = False) -> None:
    """ValueError (one line) on a GPU without float8 tensor cores: NVIDIA below compute capability 8.9 (A100 8.0,
    A10 8.6, V100 7.0, T4 7.5), AMD before MI300 (gfx942, reported as 9.4)."""
    floor = FLOAT8_CAPABILITY["rocm" if rocm else "cuda"]
    first = "MI300" if rocm else "L4, L40S, H100, H200, B200"
    if tuple(capability) < floor:
        raise ValueError(f"--float8: {name} (compute capability {capability[0]}.{capability[1]}) has no float8 tensor "
                         f"cores; they start at {floor[0]}.{floor[1]} ({first})")


def has_float8_cores(device) -> bool:
    """Whether `device` multiplies in float8 itself; elsewhere (a CPU, an older GPU) torchao can only emulate."""
    import torch

    if device.type != "cuda":
        return False
    floor = FLOAT8_CAPABILITY["rocm" if torch.version.hip else "cuda"]
    return torch.cuda.get_device_capability(device) >= floor


def apply_float8(model, recipe: str, shards: bool, emulate: bool, tp: int = 1,
                 float8_all_gather: bool | None = None) -> list[str]:
    """Swap the block linears of `float8_linear_names` for torchao's Float8Linear, in place: on the model as built
    (the meta device will do), before tensor parallel and FSDP2, which then shard Float8Linear's weight as they
    shard a Linear's (torchtitan's order). `shards`: FSDP2 shards the weights, so tensorwise gathers them in
    float8 unless `float8_all_gather` says no; `emulate`: no float8 tensor cores (a CPU). Parameter names do not
    change, and the state dict holds plain tensors: a float8 run's checkpoint loads where torchao is not even
    installed. Returns the names converted; ValueError (one line) for what torchao does not do."""
    import dataclasses
    import logging

    if recipe not in RECIPES:
        raise ValueError(f"--float8 {recipe}: choose one of {', '.join(RECIPES)}")
    gather = shards and recipe == "tensorwise" if float8_all_gather is None else float8_all_gather and shards
    if gather and recipe != "tensorwise":
        raise ValueError(f"--float8 {recipe} scales each row: torchao's float8 all-gather takes one scale per tensor "
                         "(tensorwise only)")
    # torchao logs a warning for each of its compiled kernel libraries that does not match this torch build (its
    # CUDA kernels on a CPU build, ...): float8 training calls none of them (torch._scaled_mm does its matmuls)
    quiet = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate,
                                 enable_fsdp_float8_all_gather=gather)
    wanted, converted = set(float8_linear_names(model.cfg, tp)), []

    def in_block(module, fqn: str) -> bool:           # "layers.3.attention.wq": block 3's wq
        parts = fqn.split(".", 2)
        if parts[0] == "layers" and len(parts) == 3 and parts[2] in wanted:
            converted.append(fqn)
            return True
        return False

    convert_to_float8_training(model, config=config, module_filter_fn=in_block)
    if gather:       # the weights are torchao's wrappers (the float8 all-gather's hooks): a state dict unwraps them
        for name in converted:
            model.get_submodule(name).register_state_dict_post_hook(_plain_weight)
    return converted


def _plain_weight(module, state_dict, prefix, local_metadata) -> None:
    """A Float8Linear's state-dict hook (it runs whichever module's state dict holds it: the model, a pipeline's
    StagesView): the weight torchao wraps for the float8 all-gather becomes the plain tensor inside (the same memory,
    so DCP loads into it in place), a DTensor with the same placements where it was one. Else a checkpoint would
    pickle torchao's class, which a run without float8 cannot load. The inner tensor is found by
    `__tensor_flatten__`, the protocol by which torch's wrapper subclasses name their inner tensors."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    value = state_dict[prefix + "weight"]
    local = value.to_local() if isinstance(value, DTensor) else value
    if isinstance(local, WeightWithDynamicFloat8CastTensor):
        inner = getattr(local, local.__tensor_flatten__()[0][0])
        state_dict[prefix + "weight"] = inner if not isinstance(value, DTensor) else DTensor.from_local(
            inner, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride())


def precompute_scales(*models) -> None:
    """After each optimizer step, where tensorwise weights are gathered in float8: every weight's scale (from its
    largest value over all shards) in one all-reduce per model (a rank's pipeline stages: one each), which the next
    all-gathers use. Without it, each weight's all-gather first all-reduces its own largest value."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for model in models:
        precompute_float8_dynamic_scale_for_fsdp(model)
