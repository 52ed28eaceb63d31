"""Measuring plumbing for notebook 07's parallel models: the collectives and bytes of one step (`step_collectives`),
a compile backend that counts the graphs it is handed (`GraphCounter`), and the tables that print what the workers
returned.

Why a module: the notebook's workers build the models and compare them with one process (the `parallelize_module`,
the `fully_shard`, the `torch.compile` and the comparison the reader copies are the notebook's cells); counting what a
step sends and what Dynamo compiles is machinery that would bury that code. The workers take these as arguments, so
they import nothing from `helpers`; the tables turn their returned values into lines in the kernel.
"""
from __future__ import annotations

import torch


def tp_table(reports: dict) -> str:
    """One rank's reports from notebook 07's `compare_with_reference`, {sequence parallel?: report}, as three lines
    each: the logits' placements and the largest gaps to the reference, block 0's collectives per pass, the step's."""
    lines = []
    for sp, r in reports.items():
        block = r["per_module"].get("Llama.layers.0", {})
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
