"""Figures of notebook 05 (mixed precision, activation checkpointing): each takes measured results, draws them,
returns the Figure. Nothing here measures."""
from __future__ import annotations

import math

from helpers.plots import new_figure

MODE_COLORS = {"fp32": "tab:blue", "tf32": "tab:cyan", "bf16": "tab:green", "fp16": "tab:orange"}


def scaler_trajectory(log: list[dict], growth_interval: int):
    """GradScaler at work: the loss scale per step (log2), overflowed steps marked, and the loss."""
    fig, (ax, ax_loss) = new_figure(2, width=5.5)
    steps = [r["step"] for r in log]
    ax.step(steps, [math.log2(r["scale"]) for r in log], where="post", color="tab:blue", label="loss scale")
    skipped = [r for r in log if r["overflow"]]
    ax.scatter([r["step"] for r in skipped], [math.log2(r["scale"]) for r in skipped], color="tab:red",
               marker="x", zorder=3, label="inf/nan found: step skipped, scale halved")
    ax.set_xlabel("step")
    ax.set_ylabel("log2(loss scale)")
    ax.set_title(f"GradScaler (growth_interval={growth_interval})")
    ax.legend(fontsize=8)
    ax_loss.plot(steps, [r["loss"] for r in log], color="tab:gray")
    ax_loss.scatter([r["step"] for r in skipped], [r["loss"] for r in skipped], color="tab:red", marker="x",
                    zorder=3)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss (fp16 autocast)")
    ax_loss.set_title("loss; skipped steps leave the weights unchanged")
    return fig


def precision_comparison(bench: dict, speedup: dict[str, dict], modes: list[str]):
    """Loss curves of each precision from the same start, their distance from fp32, and each mode's step speed-up
    (median of per-step ratios, with its interval as an error bar) beside the matmul ceilings of the same run.

    bench: notebook 05's `time_precisions` result after `helpers.measure.precision.split_warmup`;
    speedup[mode] = {'median', 'low', 'high'}.
    A mode named 'bf16 + compile' is drawn against the ceiling of 'bf16'.
    """
    fig, (ax_loss, ax_diff, ax_speed) = new_figure(3, width=4.6)
    for mode in modes:
        losses = bench["losses"][mode]
        style = {"label": mode, "color": MODE_COLORS.get(mode), "linestyle": "-" if mode in MODE_COLORS else ":"}
        ax_loss.plot(range(1, len(losses) + 1), losses, alpha=0.9, **style)
        if mode != "fp32":
            diff = [a - b for a, b in zip(losses, bench["losses"]["fp32"])]
            ax_diff.plot(range(1, len(diff) + 1), diff, **style)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss")
    ax_loss.set_title("same weights, same batches")
    ax_loss.legend(fontsize=8)
    ax_diff.axhline(0.0, color=MODE_COLORS["fp32"], linewidth=1)
    ax_diff.set_xlabel("step")
    ax_diff.set_ylabel("loss minus fp32 loss")
    ax_diff.set_title("distance from the fp32 curve")
    ax_diff.legend(fontsize=8)

    x = range(len(modes))
    width = 0.27
    base = [m.split(" + ")[0] for m in modes]
    med = [speedup[m]["median"] for m in modes]
    err = [[med[i] - speedup[m]["low"] for i, m in enumerate(modes)],
           [speedup[m]["high"] - med[i] for i, m in enumerate(modes)]]
    shape = [bench["flops_model"][b] / bench["flops_model"]["fp32"] for b in base]
    square = [bench["flops_square"][b] / bench["flops_square"]["fp32"] for b in base]
    ax_speed.bar([i - width for i in x], med, width, yerr=err, capsize=3, label="training step (median, interval)",
                 color=[MODE_COLORS.get(b) for b in base])
    ax_speed.bar(list(x), shape, width, label="matmul, the model's MLP shape", color="lightgray",
                 edgecolor="black")
    ax_speed.bar([i + width for i in x], square, width, label="matmul, large square", color="white",
                 edgecolor="black", hatch="//")
    ax_speed.axhline(1.0, color="black", linewidth=0.8)
    ax_speed.set_xticks(list(x), [m.replace(" + ", "\n+ ") for m in modes], fontsize=8)
    ax_speed.set_yscale("log")
    ax_speed.set_ylabel("speed-up over fp32 (log scale)")
    ax_speed.set_title(bench["hardware"]["name"], fontsize=10)
    ax_speed.legend(fontsize=7)
    return fig


def activation_checkpointing(result: dict):
    """Per checkpointing mode: bytes saved for backward, alive after forward and at the peak of one step, against
    the step time."""
    fig, (ax_mem, ax_time) = new_figure(2, width=5.2)
    modes = list(result["saved_bytes"])
    mib = 2.0 ** 20
    bars = {"saved for backward (autograd's hooks)": ("saved_bytes", "tab:blue"),
            "alive after forward": ("held_bytes", "tab:green"), result["peak_label"]: ("peak_bytes", "tab:purple")}
    width = 0.8 / len(bars)
    for i, (label, (key, color)) in enumerate(bars.items()):
        offset = (i - (len(bars) - 1) / 2) * width
        ax_mem.bar([m + offset for m in range(len(modes))], [result[key][mode] / mib for mode in modes], width,
                   label=label, color=color)
    ax_mem.set_xticks(range(len(modes)), modes)
    ax_mem.set_ylabel("MiB")
    ax_mem.set_title(f"Llama, {result['n_layers']} blocks, checkpointing")
    ax_mem.legend(fontsize=8)
    ax_time.bar(range(len(modes)), [result["step_ms"][mode] for mode in modes], 0.5)
    ax_time.set_xticks(range(len(modes)), modes)
    ax_time.set_ylabel("step time, ms (median)")
    ax_time.set_title("the price: recomputation")
    return fig


DTYPE_COLORS = {"float32": "tab:blue", "bfloat16": "tab:green", "float16": "tab:orange"}


def collective_bytes(rows: list[tuple[str, str, float]], title: str):
    """Bytes per training step moved by each collective, one bar per (label, dtype, bytes), coloured by dtype."""
    fig, (ax,) = new_figure(1, width=8.0, height=0.45 * len(rows) + 1.2)
    values = [r[2] / 2.0 ** 20 for r in rows]
    ax.barh(range(len(rows)), values, color=[DTYPE_COLORS.get(r[1], "tab:gray") for r in rows])
    ax.set_yticks(range(len(rows)), [f"{r[0]} ({r[1]})" for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("MiB per step, per rank")
    ax.set_title(title)
    return fig


def float8_losses(curves: dict[str, list[float]], reference: str = "bf16"):
    """Loss curves of the same run in bf16 and in each float8 recipe (notebook 05's float8 section), and each float8
    curve's distance from the reference, step by step."""
    fig, (ax_loss, ax_diff) = new_figure(2, width=5.0)
    for mode, losses in curves.items():
        steps = range(1, len(losses) + 1)
        ax_loss.plot(steps, losses, label=mode)
        if mode != reference:
            ax_diff.plot(steps, [a - b for a, b in zip(losses, curves[reference])], label=f"{mode} - {reference}")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss (rank 0's batches)")
    ax_loss.set_title("the same run, three precisions")
    ax_loss.legend(fontsize=8)
    ax_diff.axhline(0.0, color="tab:gray", linewidth=0.8)
    ax_diff.set_xlabel("step")
    ax_diff.set_ylabel(f"loss minus {reference}'s")
    ax_diff.set_title("what float8's rounding moved")
    ax_diff.legend(fontsize=8)
    return fig
