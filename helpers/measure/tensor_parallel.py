"""Measuring notebook 07's parallel models against their references: what a tensor-parallel model computed beside
one process's, what TP and FSDP send and take per step, and a compiled model beside its eager twin.

Why a module: the notebook's workers build the models (the `parallelize_module`, the `fully_shard`, the
`torch.compile` the reader copies); turning what they built into comparable plain numbers (largest gaps, bytes
held, collective counts, graph counts) is bookkeeping that would bury that code. The workers are the notebook's;
they take these functions (and `GraphCounter`, a counting compile backend) as arguments, so they import nothing
from `helpers`; the tables turn their returned values into lines in the kernel.
"""
from __future__ import annotations

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
        block = r["per_module"].get("GPT.layers.0", {})
        lines += [f"sequence parallel {sp}: logits {r['logits_placements']}, max |logits - reference| "
                  f"{r['logits_gap']:.2e}, max |grad - reference| {r['grad_gap']:.2e}",
                  f"  collectives of block 0: forward {block.get('forward', {})}, backward {block.get('backward', {})}",
                  f"  whole step: {r['total']}"]
    return "\n".join(lines)


def step_collectives(step) -> dict:
    """One call of `step()` under a `CollectiveLog`, as plain values: `collectives` {kind: {"calls", "ring_bytes"}}
    and `bytes_sent` (ring bytes this rank sends). A worker takes it as an argument and hands it its step."""
    from helpers.measure.comm_log import CollectiveLog

    log = CollectiveLog()
    with log:
        step()
    return {"collectives": {kind: {"calls": v["calls"], "ring_bytes": log.ring_bytes_sent(kind)}
                            for kind, v in log.summary().items()},
            "bytes_sent": log.ring_bytes_sent()}


def cost_table(cost: dict) -> str:
    """{strategy: `step_collectives`' values and "seconds" (timed steps)} as one line per strategy: median step
    time, bytes sent per rank, calls per kind."""
    from helpers.measure.timing import summarize

    lines = []
    for s, r in cost.items():
        t = summarize(r["seconds"])
        lines.append(f"{s.upper():<5} step {t['median_s'] * 1e3:8.1f} ms (IQR/2 {t['half_iqr_s'] * 1e3:.1f} ms)   "
                     f"sent per rank {r['bytes_sent'] / 2**20:7.2f} MiB   calls "
                     f"{ {k: v['calls'] for k, v in r['collectives'].items()} }")
    return "\n".join(lines)


class GraphCounter:
    """A `torch.compile` backend that records the node count of every graph it is handed (Dynamo's, or each piece
    DDPOptimizer cuts at DDP's bucket boundaries) and compiles it with the named `backend`. A worker takes one as an
    argument (each rank gets its own copy), clears `graphs` and passes it to `torch.compile(..., backend=counter)`.

    torch.compile takes a backend's name or a callable, and no public API turns a name into its callable: the
    wrapped one comes from helpers.torch_private ("lookup_backend")."""

    def __init__(self, backend: str):
        known = torch.compiler.list_backends(exclude_tags=())
        if backend not in known:
            raise ValueError(f"unknown torch.compile backend {backend!r}; this torch has {known}")
        self.backend, self.graphs = backend, []

    def __call__(self, gm, example_inputs):
        from helpers.torch_private import resolve

        self.graphs.append(len(gm.graph.nodes))
        return resolve("lookup_backend")(self.backend)(gm, example_inputs)


def compile_table(result: dict) -> str:
    """One rank's {kind: "graphs" (a `GraphCounter`'s node counts), "first_step_s", "gap", "compiled_s", "eager_s"}
    as one line per kind."""
    from helpers.measure.timing import summarize

    lines = []
    for kind, r in result.items():
        c, e = summarize(r["compiled_s"])["median_s"], summarize(r["eager_s"])["median_s"]
        lines.append(f"{kind:<6} graphs compiled {len(r['graphs'])} (nodes {r['graphs']}); first step "
                     f"{r['first_step_s']:.1f} s; step eager {e * 1e3:.1f} ms, compiled {c * 1e3:.1f} ms; "
                     f"max |grad gap| {r['gap']:.1e}")
    return "\n".join(lines)
