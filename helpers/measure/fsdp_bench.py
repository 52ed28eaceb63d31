"""What a bf16 `MixedPrecisionPolicy` costs at world size 1 on a GPU, and which FSDP2 knobs win it back.

Why a benchmark here and not in the notebook: with one GPU FSDP2 shards over a mesh of one rank, so every
"all-gather" is a copy, and each block's bf16 weights are cast and gathered before its forward and, resharded, again
before its backward; plain `torch.autocast` on the unwrapped model casts per op instead. The timing loop, its
warm-up and the repeats are machinery; the knobs (`reshard_after_forward=False`, explicit prefetch, `torch.compile`
per block before `fully_shard`) are what notebooks 03 and 03b teach. Timings are shown with their spread and judged by
nothing: they depend on the GPU, the model size and the load.
"""
from __future__ import annotations

import torch

from helpers.measure.timing import time_steps

CONFIGS = {"bf16 autocast, no FSDP": None, "FSDP2 bf16 policy, defaults": {},
           "+ reshard_after_forward=False": {"reshard_after_forward": False},
           "+ explicit prefetch": {"prefetch": True}, "+ torch.compile per block": {"compile": True}}


def bf16_step_times(device, recipe, per_rank_batch: int, repeats: int) -> dict:
    """Seconds per training step for each of `CONFIGS` (a list of `repeats`), or the error a knob raised.

    `recipe` is notebook 03b's namespace: `model()`, `apply_fsdp(model, mesh, **kw)`, `set_prefetch(model)`,
    `loss(logits, y)`, `batch(n, generator=g)`. Runs in a worker with a GPU.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    x, y = (t.to(device) for t in recipe.batch(per_rank_batch, generator=torch.Generator().manual_seed(0)))
    out = {}
    for label, knobs in CONFIGS.items():
        torch.manual_seed(0)
        model = recipe.model().to(device)
        if knobs is not None:
            if knobs.get("compile"):
                for block in model.blocks:
                    block.compile()
            recipe.apply_fsdp(model, mesh, mp_policy=mp, **{k: v for k, v in knobs.items() if k.startswith("reshard")})
            if knobs.get("prefetch"):
                recipe.set_prefetch(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=knobs is None):
                loss = recipe.loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()

        try:
            out[label] = time_steps(step, repeats, warmup=5, device=device)
        except Exception as exc:  # noqa: BLE001 - a knob this torch lacks is shown, not fatal
            out[label] = f"failed: {type(exc).__name__}: {str(exc)[:160]}"
    return out
