"""The seed articles' claims about DDP, each printed beside what notebooks 02 and 02b measured, with a computed verdict.

Why a module: notebooks 02 and 02b must show the DDP lines and the measurements (which launch, which variant, which
repeats); the wording of eight claims, their settings and the arithmetic that turns medians into a verdict with
its noise are book-keeping around them. Each function prints the claim, the measurement and the verdict
(helpers.measure.claims.verdict: 'inconclusive' where the noise straddles the claim's boundary, 'not comparable
here' where the claim's setting is not this machine's) and returns the verdicts, so a notebook may print or keep
them; none asserts anything about a timing.
"""
from __future__ import annotations

from statistics import median

from helpers.measure.claims import median_interval, verdict
from helpers.measure.ddp import percent_change
from helpers.measure.memory import zero_bytes_per_rank


def _say(claim: str, measured: str, judged: str) -> str:
    print(f"claim ({claim}\n  measured here: {measured}\n  verdict: {judged}")
    return judged


def accumulation(times: dict, micro: int, accum: int, where: str, gpu_ranks: bool, model: str) -> str:
    """Seed 000: accum_steps=4 raises throughput by 18%. times = step_times' results for "A=4" and "A=1"."""
    per_sample = {k: [t / (micro * (accum if k == "A=4" else 1)) for t in v["times"]] for k, v in times.items()}
    gain, noise = percent_change(per_sample["A=1"], per_sample["A=4"])  # time per sample, A=1 over A=4
    return _say("seed 000): accum_steps=4 raises throughput by 18% (ResNet-152, DigitalOcean GPU instances)",
                f"{gain:+.0f}% samples/s with A={accum} against A=1 (noise allows {noise[0]:+.0f}% to "
                f"{noise[1]:+.0f}%; {where}, {model}, micro-batch {micro})",
                verdict(gain, 18, 18, slack=5, unit="%", spread=noise, applicable=gpu_ranks,
                        reason=f"the claim is for GPU instances; here {where}"))


def buckets(sweep: dict, predicted: dict, smallest: float, here: str) -> list[str]:
    """Seed 000 (bucket_cap_mb=25: -38% communication), seed 001 (100 MB buckets: 15-20% faster), seed 003
    (Tensor Fusion). sweep[(cap, mode)]["times"] from step_times; predicted[cap] = bucket_plan(model, cap)."""
    exposed = {cap: median(sweep[cap, "step"]["times"]) - median(sweep[cap, "no_sync"]["times"])
               for cap in (smallest, 25)}
    out = [_say("seed 000): bucket_cap_mb=25 cuts communication overhead by 38% (>100 M parameters, cross-region VPS)",
                f"exposed communication (step - no_sync) {exposed[smallest] * 1e3:.2f} ms at {smallest} MB, "
                f"{exposed[25] * 1e3:.2f} ms at 25 MB",
                verdict(None, 38, 38, applicable=False, reason="the claim's setting is a cross-region VPS cluster "
                        f"and >100 M parameters; {here}"))]
    same_plan = predicted[100] == predicted[None]
    change, noise = percent_change(sweep[100, "step"]["times"], sweep[None, "step"]["times"])
    out.append(_say("seed 001): 100 MB buckets cut training time by 15-20% against the default (ResNet-50, 8 x V100)",
                    f"{-change:+.0f}% (noise allows {-noise[1]:+.0f}% to {-noise[0]:+.0f}%)",
                    verdict(-change, 15, 20, applicable=False, reason=(
                        f"the same {len(predicted[None])} buckets at both caps: DDP does the same work" if same_plan
                        else f"the claim is for 8 V100s; {here}"))))
    change, noise = percent_change(sweep[smallest, "step"]["times"], sweep[None, "step"]["times"])
    out.append(_say("seed 003): Tensor Fusion speeds communication up",
                    f"{len(predicted[smallest])} small buckets (fusion off) take {change:+.0f}% against DDP's "
                    f"{len(predicted[None])} fused ones (noise allows {noise[0]:+.0f}% to {noise[1]:+.0f}%)",
                    verdict(change, 0, None, unit="%", spread=noise)))
    return out


def delay_all_reduce(sweep: dict, where: str) -> str:
    """Seed 001: Apex's delay_all_reduce=True "lets communication overlap computation" (it does the opposite)."""
    ms = {m: median(sweep[None, m]["times"]) * 1e3 for m in ("step", "delayed", "no_sync")}
    change, noise = percent_change(sweep[None, "delayed"]["times"], sweep[None, "step"]["times"])
    return _say("seed 001): delay_all_reduce=True lets communication overlap computation (nodes > 5 ms apart); it "
                "does the opposite (Apex's docs: every all-reduce waits for the end of backward)",
                f"compute only {ms['no_sync']:.2f} ms; all-reduce after backward {ms['delayed']:.2f} ms; PyTorch "
                f"DDP's overlapped step {ms['step']:.2f} ms: delaying takes {change:+.0f}% (noise allows "
                f"{noise[0]:+.0f}% to {noise[1]:+.0f}%)",
                verdict(-change, 0, None, applicable=False,
                        reason=f"the claim is for nodes more than 5 ms apart; {where}"))


def find_unused_memory(ranks: list[dict]) -> str:
    """Seed 001: find_unused_parameters costs 10-15% memory. ranks: step_times' results per rank, with
    "DigitsMLP" and "DigitsMLP + find_unused" measured with memory=True (peak tensor bytes of a step)."""
    cost = 100 * (max(r["DigitsMLP + find_unused"]["peak_bytes"] / r["DigitsMLP"]["peak_bytes"] for r in ranks) - 1)
    return _say("seed 001): find_unused_parameters adds 10-15% memory",
                f"{cost:+.2f}% peak tensor bytes of a step (worst rank)", verdict(cost, 10, 15, unit="%"))


def fp16_volume(fp16_bytes: int, fp32_bytes: int) -> str:
    """Seed 001: fp16 halves communication volume (bytes counted, not timed: the same on every machine)."""
    cut = 100 * (1 - fp16_bytes / fp32_bytes)
    return _say("seed 001): fp16 cuts communication volume by 50%", f"{cut:.0f}% fewer bytes handed to all_reduce",
                verdict(cut, 50, 50, unit="%"))


def zero2(where: str) -> list[str]:
    """Seed 004: ZeRO-2 cuts memory by 43% on 32 GPUs; ZeRO's formula gives the model-state cut at every N."""
    def cut(n, mixed):
        full = sum(zero_bytes_per_rank(1, n, stage=0, mixed_precision=mixed).values())
        return 100 * (1 - sum(zero_bytes_per_rank(1, n, stage=2, mixed_precision=mixed).values()) / full)

    print("ZeRO-2 cut of model-state memory (formula), fp32 Adam / mixed precision: "
          + ", ".join(f"N={n} {cut(n, False):.1f}% / {cut(n, True):.1f}%" for n in (2, 4, 8, 32)))
    return [_say("seed 004): ZeRO-2 cuts memory by 43% (32 GPUs, 4 nodes x 8 A100)",
                 f"formula at 32 GPUs: {cut(32, False):.1f}% (fp32 Adam) or {cut(32, True):.1f}% (mixed precision)",
                 verdict(cut(32, False), 43, 43, slack=5, unit="%")),
            _say("seed 004), the same as a whole-job measurement", "not run", verdict(
                None, 43, 43, applicable=False, reason=f"the claim's setting is 32 A100s; {where}, and activations "
                                                       "(not sharded) would dilute the cut"))]


def scaling(rows: list[dict], gpus: int, cores: int) -> list[str]:
    """Seed 001 (8 GPUs give 5-7x; DDP 3-5x faster than DataParallel) and seed 004 (32 GPUs give 28x), against
    the efficiency at the largest world size of measure.ddp.weak_scaling's rows, with its noise."""
    top = rows[-1]
    low, high = median_interval([s / (top["world_size"] * rows[0]["samples_per_s"]) for s in top["rates"]])
    here = (f"{top['world_size']} {'GPUs' if gpus >= 2 else f'CPU ranks on {cores} cores'}, efficiency "
            f"{top['efficiency']:.2f} (noise allows {low:.2f}-{high:.2f})")
    out = [_say(f"{claim} (efficiency {lo:.2f}-{hi:.2f})", here, verdict(
        top["efficiency"], lo, hi, spread=(low, high), applicable=top["world_size"] == n <= gpus,
        reason=f"the claim is for {n} GPUs")) for claim, n, lo, hi in (
        ("seed 001): 8 GPUs give a 5-7x speed-up", 8, 5 / 8, 7 / 8),
        ("seed 004): 32 GPUs give 28x", 32, 28 / 32, 28 / 32))]
    out.append(_say("seed 001): DDP is 3-5x faster than nn.DataParallel on 8 V100s", "not run", verdict(
        None, 3, 5, applicable=False, reason=f"DataParallel drives several GPUs from one process; this machine has "
                                             f"{gpus} GPU(s), the claim's setting is 8 V100s")))
    return out


def loader(rates: dict, workers: int, pin: bool, machine: str) -> list[str]:
    """Seed 000: num_workers = 4 x GPUs with pin_memory loads 37% faster; prefetch_factor=4 helps when GPU-Util is
    under 60%. rates: loader_throughput's samples/s per setting, in the order none, workers, workers + prefetch 4."""
    per_sample = [[1 / r for r in rs] for rs in rates.values()]
    gain, noise = percent_change(per_sample[0], per_sample[1])
    first = _say("seed 000): num_workers = 4 x GPUs with pin_memory loads 37% faster (Linode GPU instance)",
                 f"{gain:+.0f}% with {workers} workers against none (noise allows {noise[0]:+.0f}% to "
                 f"{noise[1]:+.0f}%)",
                 verdict(gain, 37, 37, slack=5, unit="%", spread=noise, applicable=pin,
                         reason=f"pin_memory only matters with a GPU, and 4 x 0 GPUs is no worker; here {machine}"))
    gain, noise = percent_change(per_sample[1], per_sample[2])
    second = _say("seed 000): prefetch_factor=4 helps when GPU-Util is under 60%",
                  f"{gain:+.0f}% against the default 2 (noise allows {noise[0]:+.0f}% to {noise[1]:+.0f}%)",
                  verdict(gain, 0, None, unit="%", spread=noise, applicable=pin,
                          reason=f"the advice is for a GPU that waits on its loader; here {machine}"))
    return [first, second]


def overhead(ddp_times: list[float], plain_times: list[float], target: float, setting: str) -> float:
    """DDP's own cost at world size 1 (its hooks, bucket copies, one all-reduce of one rank) against the plain
    module's step, timed side by side, held to `target` percent: 'met' only where the whole noise interval is at or
    under it, 'missed' where it is all above, else 'inconclusive'. Prints both medians; returns the percentage."""
    def ms(times):  # the median and the spread of the repeats, as docs/measurements.md records a figure
        low_ms, high_ms = min(times) * 1e3, max(times) * 1e3
        return f"{median(times) * 1e3:.2f} ms (min-max {low_ms:.2f}-{high_ms:.2f}, {len(times)} repeats)"

    change, (low, high) = percent_change(ddp_times, plain_times)
    print(f"world size 1, {setting}:\n  plain step {ms(plain_times)}\n  DDP step   {ms(ddp_times)}\n"
          f"DDP overhead {change:+.1f}% (noise allows {low:+.1f}% to {high:+.1f}%); "
          f"the target of at most {target:g}%: "
          + ("met" if high <= target else "missed" if low > target
             else f"inconclusive (the noise straddles {target:g}%)"))
    return change
