"""Reading a parameter server's record (notebook 04): rates, speed-ups, bytes per codec, ring vs PS, a crash.

Why a module: notebook 04's servers record what happened (snapshots with their time and sample count, the
staleness of every update, what each trainer sent); turning that record into a table, a ratio with its noise
and a verdict on an article's claim is bookkeeping, not the RPC the reader is learning. The closed forms of the
bytes a parameter server and a ring all-reduce move per round live here too, with a unit test.
"""
from __future__ import annotations

import statistics

from helpers.measure.claims import median_interval, verdict


def interval_rates(run: dict) -> list[float]:
    """Samples per second between consecutive snapshots of a server's record (`run['curve']`)."""
    c = run["curve"]
    return [(b["samples"] - a["samples"]) / (b["time"] - a["time"]) for a, b in zip(c, c[1:])]


def print_runs(runs: dict[str, dict]) -> None:
    """One line per server record: updates, wall time, rates, final accuracy, mean staleness."""
    print(f"{'':>14} {'updates':>8} {'wall s':>7} {'updates/s':>10} {'samples/s':>10} {'final acc':>9} "
          f"{'mean staleness':>15}")
    for label, r in runs.items():
        print(f"{label:>14} {r['updates']:>8} {r['wall']:>7.2f} {r['updates'] / r['wall']:>10.1f} "
              f"{r['samples'] / r['wall']:>10.0f} {r['curve'][-1]['accuracy']:>9.3f} "
              f"{sum(r['staleness']) / len(r['staleness']):>15.2f}")


def judge_speedup(label: str, claimed: float, faster: dict, slower: dict, here: str) -> float:
    """Print seed 003's claim, this machine's ratio of samples/s with its noise, and two verdicts; return the ratio.

    Both servers snapshot after the same numbers of samples, so the ratio is taken interval by interval, side by
    side; its median and a bootstrap interval of the median carry the noise. The article's figure is for 32 GPUs
    across a network ('not comparable here'); whether the faster design is faster at all can be judged here.
    """
    ratios = [f / s for f, s in zip(interval_rates(faster), interval_rates(slower))]
    ratio, (low, high) = statistics.median(ratios), median_interval(ratios)
    print(f"claim (seed 003): {label} {claimed}x faster than synchronous SGD; setting: ResNet-50, 8 nodes x 4 A100")
    print(f"measured here: {ratio:.2f}x samples/s (90% interval {low:.2f}-{high:.2f}x, {len(ratios)} intervals); "
          f"setting: {here}")
    print(f"  verdict on {claimed}x: " + verdict(ratio, claimed, claimed, slack=0.1, applicable=False, reason=(
        f"the claim is for 32 GPUs training ResNet-50 across a network; here {here}")))
    print("  faster at all here (1x or more)? " + verdict(ratio, 1.0, None, unit="x", spread=(low, high)))
    return ratio


def codec_rows(compressed: dict[str, list], make_codec, shapes: list[tuple[int, ...]]) -> list[dict]:
    """One row per codec spec from `{spec: ps_job's results by rank}`: every trainer's bytes per update, the
    codec's arithmetic for `shapes`, the server's final accuracy and samples per second; printed as a table."""
    rows = []
    for spec, result in compressed.items():
        codec = make_codec(spec)
        sent = [b for trainer in result[1:] for b in trainer["sent"]]
        rows.append({"codec": codec.name, "spec": spec, "sent": sent, "expected": codec.expected_bytes(shapes),
                     "bytes_per_update": sent[0], "accuracy": result[0]["curve"][-1]["accuracy"],
                     "samples_per_s": result[0]["samples"] / result[0]["wall"]})
    for r in rows:
        print(f"{r['codec']:>28}: {r['bytes_per_update']:>10,} bytes per update (arithmetic {r['expected']:,}; "
              f"{rows[0]['bytes_per_update'] / r['bytes_per_update']:6.1f}x less), final test accuracy "
              f"{r['accuracy']:.3f}, {r['samples_per_s']:.0f} samples/s")
    return rows


def server_and_ring_bytes(n: int, gradient_bytes: float) -> dict[str, float]:
    """Bytes per round for n workers exchanging a gradient of `gradient_bytes`, in closed form.

    Parameter server: its link carries n gradients up and n copies of the parameters down (2n units), and that
    is all the traffic there is. Ring all-reduce: each rank sends and receives 2(n-1)/n units; the total sent
    is n times half that. Returns both links, both totals, and the cuts (percent) the ring makes on each.
    """
    server_link = 2 * n * gradient_bytes
    ring_link = 2 * 2 * (n - 1) / n * gradient_bytes
    ring_total = n * ring_link / 2
    return {"server_link": server_link, "ring_link": ring_link, "server_total": server_link, "ring_total": ring_total,
            "busiest_cut": 100 * (1 - ring_link / server_link), "total_cut": 100 * (1 - ring_total / server_link)}


def ring_against_server(ns, gradient_bytes: float, workers: int) -> dict[int, dict]:
    """Seed 001's claim (a ring all-reduce moves 50-70% fewer bytes than a parameter server) judged on counted
    bytes: `server_and_ring_bytes` for each n in `ns` (and `workers`), one line per n in MB per round, then the
    verdict on the total cut for `workers` workers. Returns the byte counts by n."""
    print("\nclaim (seed 001): ring all-reduce needs 50-70% less communication than a parameter server")
    out = {}
    for n in sorted(set(ns) | {workers}):
        b = out[n] = server_and_ring_bytes(n, gradient_bytes)
        print(f"  {n} workers, per round: parameter server's link {b['server_link'] / 1e6:.2f} MB, a ring rank's "
              f"{b['ring_link'] / 1e6:.2f} MB ({b['busiest_cut']:.0f}% less on the busiest link); total "
              f"{b['server_total'] / 1e6:.2f} MB vs {b['ring_total'] / 1e6:.2f} MB ({b['total_cut']:.0f}% less)")
    print(f"verdict for {workers} workers, total bytes: {verdict(out[workers]['total_cut'], 50, 70, unit='%')}; "
          "the busiest link gains at least as much, and its gain grows with the number of workers. Bytes are counted "
          "from the payloads and the ring's closed form, not timed: no noise enters, and the figure holds on any "
          "network.")
    return out


def print_crash(error, server: dict, elapsed_s: float) -> None:
    """What each part saw when a trainer died: the launcher's verdict (`error`, a WorkerError), the server's events
    and its record (`server`, ps_job's return value), and how long the whole job took."""
    print(f"the launcher: {str(error).splitlines()[0]}")
    for e in server["events"]:
        print(f"the server, {e['time']:.2f} s into training, after update {e['update']}: {e['trainer']}: {e['what']}")
    print(f"the server went on: {server['updates']} updates, {server['samples']} samples, final test accuracy "
          f"{server['curve'][-1]['accuracy']:.3f}; its graceful shutdown: {server['shutdown']}")
    print(f"the whole job ended after {elapsed_s:.1f} s, none of it hanging")
