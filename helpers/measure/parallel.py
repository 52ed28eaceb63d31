"""Measuring notebook 07's parallel models against their references: what a tensor-parallel model computed beside
one process's, where each element of a 2-D-sharded parameter lives, what TP and FSDP send and take per step, and a
compiled model beside its eager twin.

Why a module: the notebook's workers build the models (the `parallelize_module`, the `fully_shard`, the
`torch.compile` the reader copies); turning what they built into comparable plain numbers (largest gaps, bytes
held, collective counts per module, timing loops, graph counts) is bookkeeping that would bury that code. The
workers take these functions as arguments, so they stay free of `helpers` and run unchanged under torchrun;
`step_cost` and `compiled_vs_eager` are bodies for the recipe's `run_distributed` (which makes the process group and
passes the device) and take the rest of the recipe (the model, the batch, the parallelisms) as arguments.
"""
from __future__ import annotations

import time

import torch


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the CPU, detached: a DTensor gathered with `full_tensor()`, a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()


def short_counts(counts: dict) -> dict[str, int]:
    """CommDebugMode's {op overload: calls} as {short op name: calls} (`c10d_functional.all_gather_into_tensor`
    -> `all_gather_into_tensor`)."""
    return {str(op).split(".")[-1]: n for op, n in counts.items()}


def tp_report(model, logits, reference, ref_logits, comm, rtol: float = 1e-5, atol: float = 1e-5) -> dict:
    """A TP model after one forward and backward (under `CommDebugMode` `comm`) beside the unsplit `reference`
    after the same: the logits' placements, largest gaps and closeness of logits and of every gradient, the
    parameter bytes this rank holds, each parameter's placements, and the collectives per module and pass."""
    ref_grads = {n: p.grad.detach().cpu() for n, p in reference.named_parameters()}
    grads = {n: full(p.grad) for n, p in model.named_parameters()}
    return {
        "logits_placements": str(logits.placements),
        "logits_gap": (full(logits) - ref_logits.detach().cpu()).abs().max().item(),
        "logits_close": torch.allclose(full(logits), ref_logits.detach().cpu(), rtol=rtol, atol=atol),
        "grads_close": all(torch.allclose(g, ref_grads[n], rtol=rtol, atol=atol) for n, g in grads.items()),
        "grad_gap": max((g - ref_grads[n]).abs().max().item() for n, g in grads.items()),
        "local_param_bytes": sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in model.parameters()),
        "placements": {n: str(getattr(p, "placements", "plain tensor")) for n, p in model.named_parameters()},
        "per_module": {fqn: {pass_: short_counts(ops) for pass_, ops in passes.items()}
                       for fqn, passes in comm.comm_module_counts.items()},
        "total": short_counts(comm.get_comm_counts()),
    }


def tp_table(reports: dict) -> str:
    """One rank's `tp_report`s, {sequence parallel?: report}, as three lines each: the logits' placements and the
    largest gaps to the reference, block 0's collectives per pass, and the whole step's."""
    lines = []
    for sp, r in reports.items():
        block = r["per_module"].get("GPT.blocks.0", {})
        lines += [f"sequence parallel {sp}: logits {r['logits_placements']}, max |logits - reference| "
                  f"{r['logits_gap']:.2e}, max |grad - reference| {r['grad_gap']:.2e}",
                  f"  collectives of block 0: forward {block.get('forward', {})}, backward {block.get('backward', {})}",
                  f"  whole step: {r['total']}"]
    return "\n".join(lines)


def element_owners(model) -> dict:
    """Where every element of a DTensor model lives, seen from this rank: `owners` {name: the global flat indices
    of the elements this rank holds (an index tensor distributed with the parameter's own mesh and placements)},
    `layout_ok` (that recipe reproduces each parameter's local shard, checked on the parameter itself), and each
    parameter's `placements` (str) and global `shapes`. Call `model.reshard()` first under FSDP2."""
    from torch.distributed.tensor import distribute_tensor

    owners, layout_ok = {}, True
    for name, p in model.named_parameters():
        index = torch.arange(p.numel(), dtype=torch.float32, device=p.device).view(p.shape)
        owners[name] = distribute_tensor(index, p.device_mesh, p.placements).to_local().long().flatten().cpu()
        mine = distribute_tensor(p.detach().full_tensor(), p.device_mesh, p.placements).to_local()
        layout_ok &= torch.equal(mine, p.to_local())
    return {"owners": owners, "layout_ok": layout_ok,
            "placements": {n: str(p.placements) for n, p in model.named_parameters()},
            "shapes": {n: tuple(p.shape) for n, p in model.named_parameters()}}


def step_cost(device, make_model, get_batch, apply_tp, apply_fsdp, parallel_loss, batch: int, repeats: int) -> dict:
    """In every rank, inside a process group (`run_distributed(step_cost, ...)`): one training step's collectives
    (calls, ring bytes) and `repeats` timed steps, TP over all ranks against FSDP over all ranks at the same global
    batch (TP: every rank the whole batch; FSDP: each rank its part). `make_model()` builds the model from the
    current seed; `get_batch(n, generator)` gives (x, y). Returns plain values."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from helpers.measure.comm_log import CollectiveLog
    from helpers.measure.timing import time_steps

    world, out = dist.get_world_size(), {}
    for strategy in ("tp", "fsdp"):
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=(strategy,))
        torch.manual_seed(0)
        model = make_model().to(device)
        gen = torch.Generator().manual_seed(0 if strategy == "tp" else dist.get_rank())
        x, y = (t.to(device) for t in get_batch(batch * world if strategy == "tp" else batch, gen))
        if strategy == "tp":
            model = apply_tp(model, mesh)
            step = lambda: parallel_loss(model(x), y)  # noqa: E731
        else:
            model = apply_fsdp(model, mesh)
            step = lambda: F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()  # noqa: E731
        step()
        log = CollectiveLog()
        with log:
            step()
        out[strategy] = {"collectives": {kind: {"calls": v["calls"], "ring_bytes": log.ring_bytes_sent(kind)}
                                         for kind, v in log.summary().items()},
                         "bytes_sent": log.ring_bytes_sent(), "seconds": time_steps(step, repeats, device=device)}
        del model, step
    return out


def cost_table(cost: dict) -> str:
    """`step_cost`'s result as one line per strategy: median step time, bytes sent per rank, calls per kind."""
    from helpers.measure.timing import summarize

    lines = []
    for s, r in cost.items():
        t = summarize(r["seconds"])
        lines.append(f"{s.upper():<5} step {t['median_s'] * 1e3:8.1f} ms (IQR/2 {t['half_iqr_s'] * 1e3:.1f} ms)   "
                     f"sent per rank {r['bytes_sent'] / 2**20:7.2f} MiB   calls "
                     f"{ {k: v['calls'] for k, v in r['collectives'].items()} }")
    return "\n".join(lines)


def compiled_vs_eager(device, compiled_and_eager, get_batch, batch: int, backend: str, repeats: int,
                      kinds=("plain", "DDP", "FSDP2")) -> dict:
    """In every rank, inside a process group (`run_distributed(compiled_vs_eager, ...)`): for each kind,
    `compiled_and_eager(kind, counting_backend, device)` returns a compiled model and its eager twin (same weights);
    measured: the graphs the compiler was handed (node counts), the first step's seconds (it compiles), both models'
    gradients after one step (close at rtol = atol = 1e-4, and the largest gap), and `repeats` timed steps of each.
    Returns plain values."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from helpers.measure.timing import time_steps

    x, y = (t.to(device) for t in get_batch(batch, torch.Generator().manual_seed(dist.get_rank())))
    graphs: list[int] = []

    def counting(gm, example_inputs):  # sees every graph Dynamo (and DDPOptimizer) hands over
        graphs.append(len(gm.graph.nodes))
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    def step(model):
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()

    def grads_after_step(model):
        step(model)
        return [full(p.grad).clone() for p in model.parameters()]

    out = {}
    for kind in kinds:
        torch._dynamo.reset()
        graphs.clear()
        compiled, eager = compiled_and_eager(kind, counting, device)
        start = time.perf_counter()
        got = grads_after_step(compiled)  # the first call compiles
        first = time.perf_counter() - start
        want = grads_after_step(eager)
        out[kind] = {"graphs": list(graphs), "first_step_s": first,
                     "close": all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(got, want)),
                     "gap": max((a - b).abs().max().item() for a, b in zip(got, want)),
                     "compiled_s": time_steps(lambda: step(compiled), repeats, warmup=1, device=device),
                     "eager_s": time_steps(lambda: step(eager), repeats, warmup=1, device=device)}
        del compiled, eager
    return out


def compile_table(result: dict) -> str:
    """`compiled_vs_eager`'s result for one rank as one line per kind."""
    from helpers.measure.timing import summarize

    lines = []
    for kind, r in result.items():
        c, e = summarize(r["compiled_s"])["median_s"], summarize(r["eager_s"])["median_s"]
        lines.append(f"{kind:<6} graphs compiled {len(r['graphs'])} (nodes {r['graphs']}); first step "
                     f"{r['first_step_s']:.1f} s; step eager {e * 1e3:.1f} ms, compiled {c * 1e3:.1f} ms; "
                     f"max |grad gap| {r['gap']:.1e}")
    return "\n".join(lines)
