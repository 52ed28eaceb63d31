"""Figures of notebooks 03 and 03b (FSDP2, DeviceMesh, DTensor): memory per rank, collectives per step, the loss
curve, and the tables their cells print.

Each function takes what the workers measured (plain dicts) and the formula to draw beside it; none measures.
"""
from __future__ import annotations

from helpers.plots import new_figure

STATE_PARTS = ("parameters", "gradients", "optimizer")
_COLORS = {"parameters": "#4C72B0", "gradients": "#DD8452", "optimizer": "#55A868", "whole_parameters": "#C44E52",
           "all_gather": "#4C72B0", "reduce_scatter": "#DD8452", "all_reduce": "#8172B3"}


def state_bytes_bars(rows: list[dict], zero_total: dict[int, float], unit: float = 2**20, unit_name: str = "MiB"):
    """Model state per rank (stacked parameters, gradients, optimizer) for each strategy and world size.

    rows: one per (strategy, world_size), each {'strategy', 'world_size', 'parameters', 'gradients', 'optimizer',
        'activations'} in bytes (the largest rank's figure), optionally 'whole_parameters' (FSDP's all-gathered
        parameters held between forward and backward), stacked on top of the state.
    zero_total: {world_size: ZeRO's 16Ψ/N} drawn as a black tick over the FSDP bar of that world size.
    The right panel shows the activations saved for backward, which neither strategy shards.
    """
    fig, (ax, ax_act) = new_figure(ncols=2, width=5.6, height=3.8)
    strategies = sorted({r["strategy"] for r in rows})
    sizes = sorted({r["world_size"] for r in rows})
    width = 0.8 / len(strategies)
    for i, strategy in enumerate(strategies):
        for j, n in enumerate(sizes):
            row = next((r for r in rows if r["strategy"] == strategy and r["world_size"] == n), None)
            if row is None:
                continue
            x, bottom = j + (i - (len(strategies) - 1) / 2) * width, 0.0
            for part in STATE_PARTS + (("whole_parameters",) if row.get("whole_parameters") else ()):
                ax.bar(x, row[part] / unit, width * 0.9, bottom=bottom, color=_COLORS[part],
                       hatch="//" if strategy != strategies[0] else None, edgecolor="white",
                       label=part.replace("_", " ") if (i, j) == (0, 0) or part == "whole_parameters" else None)
                bottom += row[part] / unit
            ax.annotate(strategy, (x, bottom), ha="center", va="bottom", fontsize=7)
            if strategy.upper().startswith("FSDP") and n in zero_total:
                ax.plot([x - width * 0.45, x + width * 0.45], [zero_total[n] / unit] * 2, color="black", lw=2,
                        label="ZeRO 16Ψ/N" if j == 0 else None)
            ax_act.bar(x, row["activations"] / unit, width * 0.9, color="#937860",
                       hatch="//" if strategy != strategies[0] else None, edgecolor="white")
            ax_act.annotate(strategy, (x, row["activations"] / unit), ha="center", va="bottom", fontsize=7)
    for a in (ax, ax_act):
        a.set_xticks(range(len(sizes)), [f"N = {n}" for n in sizes])
    ax.set_ylabel(f"{unit_name} per rank")
    ax.set_title("model state per rank (Adam, fp32)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.3)
    ax.legend(fontsize=8, ncols=2, loc="upper right")
    ax_act.set_ylabel(f"{unit_name} per rank")
    ax_act.set_title("activations saved for backward (same per-rank batch)")
    return fig


def collective_bars(configs: dict[str, dict], unit: float = 2**20, unit_name: str = "MiB"):
    """Bytes one rank sends per training step on a ring, stacked by collective, with the call counts written on.

    configs: {label: {kind: {'calls', 'ring_bytes'}}}, e.g. 'DDP', 'FSDP (default)', ...
    """
    fig, (ax,) = new_figure(width=7.0, height=3.6)
    kinds = [k for k in ("all_gather", "reduce_scatter", "all_reduce")
             if any(k in c for c in configs.values())]
    for x, (label, summary) in enumerate(configs.items()):
        bottom = 0.0
        for kind in kinds:
            if kind not in summary:
                continue
            height = summary[kind]["ring_bytes"] / unit
            ax.bar(x, height, 0.6, bottom=bottom, color=_COLORS[kind], label=kind if x == 0 or kind not in
                   {k for s in list(configs.values())[:x] for k in s} else None)
            ax.annotate(f"{summary[kind]['calls']}×", (x, bottom + height / 2), ha="center", va="center",
                        fontsize=8, color="white")
            bottom += height
    ax.set_xticks(range(len(configs)), list(configs), fontsize=8)
    ax.set_ylabel(f"{unit_name} sent per rank per step (ring)")
    ax.set_title("collectives per training step")
    ax.legend(fontsize=8)
    return fig


def loss_curve(losses: list[float], levels: dict[str, float] | None = None, window: int = 10):
    """Training loss per step (and its running mean), with reference levels such as ln(V) drawn across."""
    fig, (ax,) = new_figure(width=7.0, height=3.6)
    steps = range(1, len(losses) + 1)
    ax.plot(steps, losses, color="#4C72B0", alpha=0.35, lw=1, label="loss (mean over ranks)")
    if len(losses) >= window:
        running = [sum(losses[i - window:i]) / window for i in range(window, len(losses) + 1)]
        ax.plot(range(window, len(losses) + 1), running, color="#4C72B0", lw=2, label=f"running mean ({window})")
    for (name, value), style in zip((levels or {}).items(), ("--", ":", "-.")):
        ax.axhline(value, color="gray", ls=style, lw=1)
        ax.annotate(name, (len(losses), value), ha="right", va="bottom", fontsize=8, color="dimgray")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats per character)")
    ax.set_title("The recipe's Llama trained with FSDP2 on CPython's language reference")
    ax.legend(fontsize=8)
    return fig


# Tables: the notebook prints what the workers measured; these lay the rows out so its cells show only the call.

def anatomy_table(ranks: list[dict], shapes: dict[str, tuple], names: list[str]) -> str:
    """What `fully_shard` made of the model: its class, one parameter's type, shape and placements at each moment
    of a step (rank 0), and the local shape of each of `names` on every rank beside the global one (`ranks` as
    `fsdp_anatomy` returns them)."""
    a0 = ranks[0]
    lines = [f"class after fully_shard: {a0['class']} (isinstance of the original class: "
             f"{a0['is_original_class']}, FSDPModule: {a0['is_FSDPModule']})"]
    lines += [f"{moment:<48} {kind:<8} {shape} {placement}" for moment, (kind, shape, placement) in a0["moments"].items()]
    lines.append(f"\n{'parameter':<32} {'global':<12} " + " ".join(f"rank {a['rank']} local" for a in ranks))
    lines += [f"{name:<32} {str(shapes[name]):<12} " + " ".join(f"{str(a['params'][name][2]):<12}" for a in ranks)
              for name in names]
    return "\n".join(lines)


def reference_table(results: dict[str, dict], attention_width: int) -> str:
    """One row per FSDP variant: the largest loss gap to the single-process reference, the parameters' gap
    relative to the distance the reference travelled, and the element that differs most (with which of q/k/v
    it is when it sits in an attention's `in_proj_bias`, whose parts are `attention_width` long)."""
    lines = [f"{'variant':<32} {'max |loss - reference|':>22} {'relative parameter gap':>23}  largest element gap"]
    for variant, r in results.items():
        dloss = max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"]))
        value, name, index = r["worst"]
        part = (f" ({('query', 'key', 'value')[index // attention_width]} part)"
                if name.endswith("in_proj_bias") else "")
        lines.append(f"{variant:<32} {dloss:>22.2e} {r['relative_gap']:>23.2e}  {value:.1e} at {name}[{index}]{part}")
    return "\n".join(lines)


def precision_table(columns: dict[str, dict]) -> str:
    """Side by side, one column per MixedPrecisionPolicy: dtypes seen, first-step collective bytes, model state,
    saved activations and the loss at the end (each column as `mixed_precision_check` returns it)."""
    names = list(columns)
    w = max(14, *(len(n) + 2 for n in names))
    rows = [f"{'':<30}" + "".join(f"{n:>{w}}" for n in names)]
    for key in ("weight_in_forward", "output", "sharded", "grad_dtype"):
        rows.append(f"{key:<30}" + "".join(f"{columns[n][key].replace('torch.', ''):>{w}}" for n in names))
    for kind in ("all_gather", "reduce_scatter"):
        rows.append(f"{kind + ' bytes, step 1':<30}"
                    + "".join(f"{columns[n]['collectives'][kind]['bytes']:>{w},}" for n in names))
    rows.append(f"{'model state bytes':<30}" + "".join(f"{sum(columns[n]['state'].values()):>{w},}" for n in names))
    rows.append(f"{'activations saved':<30}" + "".join(f"{columns[n]['activations']:>{w},}" for n in names))
    rows.append(f"{'loss, mean of last 3 steps':<30}"
                + "".join(f"{sum(columns[n]['losses'][-3:]) / 3:>{w}.4f}" for n in names))
    return "\n".join(rows)


def memory_table(ranks: list[dict], strategies: list[str], psi: int, padding: int) -> str:
    """Bytes each rank allocated for parameters, gradients and optimizer state under each strategy at one world
    size, beside ZeRO's 16Ψ (DDP) or 16Ψ/N (sharded), the parameters held whole between forward and backward and
    the activations saved; `padding` is FSDP2's padding elements over all ranks. `ranks` as `one_step_memory`
    returns them (a dict per rank with a result per strategy)."""
    n = len(ranks)
    lines = [f"{'rank':>4} {'strategy':<28} {'parameters':>11} {'gradients':>11} {'optimizer':>11} {'total':>11} "
             f"{'formula':>11} {'whole params':>12} {'activations':>12}"]
    for r in ranks:
        for strategy in strategies:
            got = r[strategy]["allocated"]
            formula = 16 * psi / (1 if strategy == "DDP" else n)
            lines.append(f"{r['rank']:>4} {strategy:<28} {got['parameters']:>11,} {got['gradients']:>11,} "
                         f"{got['optimizer']:>11,} {sum(got.values()):>11,} {formula:>11,.0f} "
                         f"{r[strategy]['whole_parameters']:>12,} {r[strategy]['activations']:>12,}")
    lines.append(f"padding at N = {n}: {padding:,} elements over all ranks")
    return "\n".join(lines)


def step_time_table(bench: dict) -> str:
    """Milliseconds per step, median [min, max], and each configuration's step over its baselines', median [min,
    max] of the round-by-round ratios (notebook 03b's `bf16_step_times` result, `helpers.measure.fsdp.with_ratios`);
    a failed configuration as its text."""
    median = lambda xs: sorted(xs)[len(xs) // 2]
    lines = [f"  {'configuration':<40} {'ms per step':>24}   step / baseline's step"]
    for label, seconds in bench["seconds"].items():
        if isinstance(seconds, str):
            lines.append(f"  {label:<40} {seconds}")
            continue
        ms = [s * 1e3 for s in seconds]
        ratios = "; ".join(f"{median(r):.2f}x [{min(r):.2f}, {max(r):.2f}] {base}"
                           for base, r in bench["ratios"].get(label, {}).items() if r)
        lines.append(f"  {label:<40} {median(ms):8.2f} [{min(ms):.2f}, {max(ms):.2f}]   {ratios or '(baseline)'}")
    return "\n".join(lines)
