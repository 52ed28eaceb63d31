"""What this machine's memory and loopback network can do at best, measured now: the ceilings a figure is read against.

Why measured and not looked up: a collective's busbw, a checkpoint's write rate or a step's copy traffic means
little without the rate the same machine reaches with nothing in the way, taken in the same run (a shared machine's
load moves both). On a CPU that is one TCP stream over loopback (the transport gloo uses between ranks on one host),
a memory copy, and half a one-byte loopback round trip; on a GPU the device's own copy rate (HBM) as well. Each is
counted as S/t, each byte once, like nccl-tests' algbw, so a busbw compares with it directly. `measure_ceilings`
runs in a worker (notebook 01b's sweep and notebook 10's take it as an argument) or in the kernel; `best_ceilings`
keeps the better of a run before and after a sweep. `transport_facts` reads the settings that network advice
touches (TCP buffers, InfiniBand, NUMA) from /proc and /sys. Rates print in GB/s with GB = 1e9 bytes (`GB`), sizes
in binary units (`human_bytes`), as every communication table of the cookbook does.
"""
from __future__ import annotations

import glob
import os
import shutil
import socket
import threading
import time

from helpers.devices import usable_cores
from helpers.measure.timing import summarize, time_steps

GB = 1e9  # nccl-tests reports GB/s with GB = 1e9 bytes


def human_bytes(n: float) -> str:
    """1024 -> '1 KiB', 1536 -> '1.5 KiB': sizes in binary units, for tables and axis ticks alike."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def memory_copy_rate(nbytes: int = 64 << 20, repeats: int = 10, device=None) -> dict:
    """How fast `dst.copy_(src)` moves `nbytes` on `device` (CPU memory, or a GPU's own memory).

    The rate is counted as S/t, each byte once, like algbw; the memory itself sees a read and a write of every
    byte, 2S/t, which the record gives as `traffic`. On CUDA the time comes from CUDA events around the copy.
    """
    import torch

    device = torch.device("cpu") if device is None else torch.device(device)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults and allocation are not the copy's cost
    if device.type == "cuda":  # tens of microseconds on a GPU: a host clock would time the synchronisation
        times = []
        stream = torch.cuda.current_stream(device)  # the copy's stream: `device`'s, whichever GPU is current
        for _ in range(repeats):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record(stream)
            dst.copy_(src)
            end.record(stream)
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
    else:
        times = time_steps(lambda: dst.copy_(src), repeats, warmup=0, barrier=False)
    stats = summarize(times)
    size = src.numel() * src.element_size()
    return {"name": f"{device.type} memory copy", "kind": "bandwidth", "size_bytes": size,
            "rate": size / stats["median_s"], "traffic": 2 * size / stats["median_s"],
            "counts": "S/t, each byte once (the memory reads and writes it: 2S/t)",
            "threads": torch.get_num_threads() if device.type == "cpu" else None, "times_s": times, **stats}


def _loopback_pair():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))  # loopback only: nothing is exposed
    server.listen(1)
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    server.close()
    for s in (client, conn):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return client, conn


def loopback_tcp_rate(nbytes: int = 64 << 20, repeats: int = 5, chunk: int = 4 << 20) -> dict:
    """One TCP stream over 127.0.0.1 in this process (a sender thread, a receiving thread): bytes per second.

    This is the transport gloo uses between ranks on one host, so it is the ceiling its busbw is read against.
    The kernel copies every byte twice (user to kernel, kernel to user); the rate is counted once, S/t.
    """
    client, conn = _loopback_pair()
    payload = memoryview(bytearray(chunk))
    sink = memoryview(bytearray(chunk))
    times = []
    try:
        for _ in range(repeats + 1):  # the first round warms the socket buffers up and is dropped
            def send():
                left = nbytes
                while left > 0:
                    piece = min(left, chunk)
                    client.sendall(payload[:piece])
                    left -= piece

            sender = threading.Thread(target=send, daemon=True)
            start = time.perf_counter()
            sender.start()
            got = 0
            while got < nbytes:
                got += conn.recv_into(sink, min(chunk, nbytes - got))
            elapsed = time.perf_counter() - start
            sender.join()
            times.append(elapsed)
    finally:
        client.close()
        conn.close()
    times = times[1:]
    stats = summarize(times)
    return {"name": "loopback TCP", "kind": "bandwidth", "size_bytes": nbytes, "rate": nbytes / stats["median_s"],
            "counts": "S/t, each byte once (one stream, one direction)", "times_s": times, **stats}


def loopback_tcp_latency(repeats: int = 200) -> dict:
    """Half the round trip of one byte over 127.0.0.1 TCP: the floor under a small gloo message."""
    client, conn = _loopback_pair()
    byte = b"x"

    def echo():
        for _ in range(repeats + 20):
            conn.sendall(conn.recv(1))

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    times = []
    try:
        for i in range(repeats + 20):
            start = time.perf_counter()
            client.sendall(byte)
            client.recv(1)
            if i >= 20:
                times.append((time.perf_counter() - start) / 2)
    finally:
        thread.join(5)
        client.close()
        conn.close()
    stats = summarize(times)
    return {"name": "loopback TCP one-way latency", "kind": "latency", "latency_s": stats["median_s"],
            "times_s": times, **stats}


def measure_ceilings(device=None, nbytes: int = 64 << 20, repeats: int = 5) -> dict:
    """The ceilings a collective on `device` is read against, measured now: name -> record.

    CPU: loopback TCP rate (gloo's transport), CPU memory copy rate, loopback TCP latency.
    GPU: the device's memory copy rate as well (an upper bound for any intra-node collective).
    """
    import torch

    device = torch.device("cpu") if device is None else torch.device(device)
    found = {"tcp": loopback_tcp_rate(nbytes, repeats), "memcpy": memory_copy_rate(nbytes, repeats * 2),
             "tcp_latency": loopback_tcp_latency()}
    if device.type == "cuda":
        found["device_copy"] = memory_copy_rate(max(nbytes, 1 << 30), repeats * 2, device)
    return found


def best_ceilings(*runs: dict) -> dict:
    """Per ceiling, the best of several `measure_ceilings` runs (highest rate, lowest latency).

    Why: on a shared machine a ceiling measured once may land in a busy moment and sit below what the collective
    achieved a minute later. Measured before and after a sweep, the better of the two is nearer the link's ability.
    """
    best: dict = {}
    for run in runs:
        for key, c in run.items():
            if key not in best:
                best[key] = c
            elif c["kind"] == "latency" and c["latency_s"] < best[key]["latency_s"]:
                best[key] = c
            elif c["kind"] == "bandwidth" and c["rate"] > best[key]["rate"]:
                best[key] = c
    return {key: {**c, "of_runs": len(runs)} for key, c in best.items()}


def format_ceilings(ceilings: dict) -> str:
    """`measure_ceilings`' (or `best_ceilings`') records as text, one line each: the rate with its IQR, or the
    latency."""
    lines = []
    for c in ceilings.values():
        if c["kind"] == "latency":
            lines.append(f"{c['name']:<32} {c['latency_s'] * 1e6:10.1f} us   (median of {len(c['times_s'])})")
        else:
            spread = f"IQR {c['size_bytes'] / c['q3_s'] / GB:.2f}-{c['size_bytes'] / c['q1_s'] / GB:.2f}"
            lines.append(f"{c['name']:<32} {c['rate'] / GB:10.2f} GB/s ({spread}; {human_bytes(c['size_bytes'])}; "
                         f"counted as {c['counts']})")
    return "\n".join(lines)


def transport_facts() -> dict:
    """What this machine has of the settings that circulating network advice touches: TCP receive-buffer limits
    (net.ipv4.tcp_rmem min/default/max and net.core.rmem_max, bytes), InfiniBand devices, NUMA nodes, numactl.

    Read from /proc and /sys (Linux); a value this machine does not expose is None.
    """
    def read(path):
        try:
            with open(path) as f:
                return [int(v) for v in f.read().split()]
        except (OSError, ValueError):
            return None

    infiniband = sorted(os.listdir("/sys/class/infiniband")) if os.path.isdir("/sys/class/infiniband") else []
    return {"tcp_rmem": read("/proc/sys/net/ipv4/tcp_rmem"), "rmem_max": (read("/proc/sys/net/core/rmem_max")
                                                                           or [None])[0],
            "infiniband": infiniband, "numa_nodes": len(glob.glob("/sys/devices/system/node/node[0-9]*")) or None,
            "numactl": shutil.which("numactl"), "cores": usable_cores()}
