"""Keep a single-host launch off the network: rendezvous through a file, peers over loopback.

Why: `init_process_group()` with the default env:// method makes rank 0 start a TCPStore, and PyTorch's TCPStore
listens on every interface (`*:PORT`) even when MASTER_ADDR is 127.0.0.1. On a shared or rented machine that is
an open port for the life of the job. For a launch whose ranks all live on this host we instead answer env://
with a FileStore in the launch's run folder (`run_folder`), and pin gloo, NCCL's bootstrap and TensorPipe to the
loopback interface. The worker code does not change: it still calls `dist.init_process_group()`, reads RANK and
WORLD_SIZE, and would run under torchrun, where this module is not installed and env:// means TCPStore again.

What stays exposed: nothing that the launcher opens. A worker that builds its own `dist.TCPStore`, or passes
`init_method="tcp://..."`, gets PyTorch's behaviour (all interfaces), as notebook 01 shows on purpose.
"""
from __future__ import annotations

import itertools
import os
from urllib.parse import urlparse

from helpers.launcher import run_folder

STORE_DIR_VAR = "COOKBOOK_STORE_DIR"
_calls = itertools.count()


def loopback_interface() -> str | None:
    """Name of the interface that carries 127.0.0.1 ('lo' on Linux, 'lo0' on macOS)."""
    try:
        import psutil
    except ImportError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(getattr(a, "address", None) == "127.0.0.1" for a in addrs):
            return name
    return None


def loopback_environment() -> dict[str, str]:
    """Variables that pin gloo, NCCL's socket bootstrap and TensorPipe (RPC) to loopback."""
    iface = loopback_interface()
    if iface is None:
        return {}
    return {"GLOO_SOCKET_IFNAME": iface, "NCCL_SOCKET_IFNAME": iface, "TP_SOCKET_IFNAME": iface}


def _query(url: str) -> dict[str, str]:
    pairs = (p.split("=", 1) for p in urlparse(url).query.split("&") if "=" in p)
    return dict(pairs)


def _file_env_handler(url: str, timeout=None, **kwargs):
    """env:// answered by a FileStore; the k-th rendezvous of every rank meets in store file k."""
    import torch.distributed as dist

    query = _query(url)
    rank = int(query.get("rank", os.environ["RANK"]))
    world_size = int(query.get("world_size", os.environ["WORLD_SIZE"]))
    store = dist.FileStore(run_folder.store_file(os.environ[STORE_DIR_VAR], next(_calls)), world_size)
    if timeout is not None:
        store.set_timeout(timeout)
    yield store, rank, world_size
    raise RuntimeError("env:// (file-backed) rendezvous cannot re-rendezvous")


def install(store_dir: str) -> bool:
    """Answer env:// from `store_dir` in this process (again with a new folder: a persistent rank's next call).
    Returns False if torch's registry has moved."""
    from helpers import torch_private

    try:
        handlers = torch_private.resolve("rendezvous_handlers")  # why a private registry: see torch_private
    except torch_private.PrivateAPIGone:
        return False
    if not isinstance(handlers, dict) or "env" not in handlers:
        return False
    global _calls
    os.environ[STORE_DIR_VAR] = store_dir
    _calls = itertools.count()  # a new folder: its rendezvous are counted from the first
    handlers["env"] = _file_env_handler
    return True
