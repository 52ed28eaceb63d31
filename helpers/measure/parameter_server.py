"""Reading a parameter server's record (notebook 04): rates, speed-ups, bytes per codec, ring vs PS, a crash.

Why a module: notebook 04's servers record what happened (snapshots with their time and sample count, the
staleness of every update, what each trainer sent); turning that record into a table or a ratio with its noise is
bookkeeping, not the RPC the reader is learning. The closed forms of the bytes a parameter server and a ring
all-reduce move per round live here too, with a unit test (the appendix of common advice reads them).
"""
from __future__ import annotations

import statistics

from helpers.measure.advice import median_interval


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


def speedup(faster: dict, slower: dict) -> dict[str, float]:
    """How many times the samples per second of `faster`'s server beat `slower`'s: {'median', 'low', 'high', 'n'}.

    Both servers snapshot after the same numbers of samples, so the ratio is taken interval by interval, side by
    side; its median and a bootstrap interval of the median carry the noise."""
    ratios = [f / s for f, s in zip(interval_rates(faster), interval_rates(slower))]
    low, high = median_interval(ratios)
    return {"median": statistics.median(ratios), "low": low, "high": high, "n": len(ratios)}


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


def print_crash(error, server: dict, elapsed_s: float) -> None:
    """What each part saw when a trainer died: the launcher's verdict (`error`, a WorkerError), the server's events
    and its record (`server`, ps_job's return value), and how long the whole job took."""
    print(f"the launcher: {str(error).splitlines()[0]}")
    for e in server["events"]:
        print(f"the server, {e['time']:.2f} s into training, after update {e['update']}: {e['trainer']}: {e['what']}")
    print(f"the server went on: {server['updates']} updates, {server['samples']} samples, final test accuracy "
          f"{server['curve'][-1]['accuracy']:.3f}; its graceful shutdown: {server['shutdown']}")
    print(f"the whole job ended after {elapsed_s:.1f} s, none of it hanging")
