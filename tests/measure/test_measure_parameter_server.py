"""helpers.measure.parameter_server: the closed forms of PS and ring bytes, and rates read from a server's record."""
from __future__ import annotations

import pytest

from helpers.measure.parameter_server import interval_rates, print_crash, server_and_ring_bytes, speedup


@pytest.mark.parametrize("n", [2, 3, 8, 64])
def test_ring_and_server_bytes_meet_the_closed_forms(n):
    b = server_and_ring_bytes(n, 1000.0)
    assert b["server_total"] == b["server_link"] == 2 * n * 1000.0  # n gradients up, n parameter copies down
    assert b["ring_total"] == pytest.approx(2 * (n - 1) * 1000.0)  # each rank sends 2(n-1)/n gradients
    assert b["total_cut"] == pytest.approx(100 / n)
    assert b["busiest_cut"] >= b["total_cut"]


def test_the_busiest_links_gain_grows_with_the_number_of_workers():
    cuts = [server_and_ring_bytes(n, 1.0)["busiest_cut"] for n in (2, 4, 8, 16)]
    assert cuts == sorted(cuts) and len(set(cuts)) == 4


def _record(times, samples):
    return {"curve": [{"time": t, "samples": s} for t, s in zip(times, samples)]}


def test_interval_rates_and_a_side_by_side_ratio():
    slow, fast = _record([0, 1, 2, 4], [0, 10, 20, 30]), _record([0, 0.5, 1, 2], [0, 10, 20, 30])
    assert interval_rates(slow) == [10.0, 10.0, 5.0]
    s = speedup(fast, slow)
    assert s["median"] == 2.0 and s["n"] == 3 and s["low"] <= 2.0 <= s["high"]


def test_print_crash_names_each_event(capsys):
    server = {"events": [{"time": 1.5, "update": 7, "trainer": "trainer2", "what": "ping failed: EPIPE"}],
              "updates": 20, "samples": 600, "curve": [{"accuracy": 0.9}], "shutdown": "timed out"}
    print_crash(RuntimeError("rank 2 died\ntraceback"), server, elapsed_s=3.0)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "the launcher: rank 2 died" and "after update 7: trainer2: ping failed: EPIPE" in out[1]
    assert "20 updates, 600 samples" in out[2] and out[3].endswith("3.0 s, none of it hanging")


def test_tensorpipe_still_takes_the_private_transports_option_that_start_rpc_passes():
    # scripts/rpc_parameter_server.py's start_rpc passes `_transports=["uv"]` when there are more processes than
    # cores (no public option chooses TensorPipe's transport): this fails first, by name, if torch drops it.
    import inspect

    import torch.distributed.rpc as rpc

    assert "_transports" in inspect.signature(rpc.TensorPipeRpcBackendOptions.__init__).parameters
    rpc.TensorPipeRpcBackendOptions(num_worker_threads=4, _transports=["uv"])  # accepted as start_rpc passes it
