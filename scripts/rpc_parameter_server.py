# Written by `./cookbook export` from notebooks/04_rpc_parameter_server.ipynb, cells tagged 'script:rpc_parameter_server.py'.
# Edit those cells, not this file. Run: torchrun --standalone --nproc-per-node=2 rpc_parameter_server.py --help
"""A parameter server on torch.distributed.rpc: rank 0 holds the model and the optimizer, ranks 1..T train on
their shard of the data, synchronously (one averaged step per round) or asynchronously (each gradient applied as
it arrives, its staleness recorded).

    torchrun --standalone --nproc-per-node=3 rpc_parameter_server.py --design async
"""
import argparse
import gc
import itertools
import logging
import os
import sys
import threading
import time
import warnings

import torch
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import nn
from torch.distributed.rpc import RRef
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def rpc_options(rpc_timeout=60, threads=16):
    """TensorPipe options. With more processes than cores, TCP only ('uv' over loopback, the private `_transports`
    option): the shared-memory transport busy-polls and would take the cores the trainers compute on. Quiets the
    deprecation warning about init_rpc's internal gloo group, and the traceback a failed graceful shutdown logs
    (section 6 reports that failure itself)."""
    warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*")
    logging.getLogger("torch.distributed.rpc.api").setLevel(logging.CRITICAL)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    crowded = int(os.environ["WORLD_SIZE"]) > cores
    return rpc.TensorPipeRpcBackendOptions(num_worker_threads=threads, rpc_timeout=rpc_timeout,
                                           **({"_transports": ["uv"]} if crowded else {}))


def serve_by_name(*objects):
    """Make functions and classes findable where RPC looks them up: by name, in `__main__`. Under torchrun they
    are there already and this does nothing; a function sent to a worker by value (a notebook cell) has no such
    home until this gives it one."""
    main = sys.modules["__main__"]
    for obj in objects:
        if getattr(main, obj.__name__, None) is not obj:
            setattr(main, obj.__name__, obj)


def mlp(hidden, depth, n_in=64, n_classes=10):
    """Notebook 02's DigitsMLP as plain layers: [0] the body (`depth` hidden ReLU layers), [1] the linear head."""
    layers, width = [], n_in
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    return nn.Sequential(nn.Sequential(*layers), nn.Linear(width, n_classes))


def accuracy(model, x, y):
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


_server = {}  # per process; on ps, ps_job puts an Event and, once the server exists, its RRef here


def server_rref():
    """Runs on ps: hands a trainer the RRef to the parameter server, once it exists."""
    if not _server["ready"].wait(timeout=60):
        raise TimeoutError("the parameter server was not created within 60 s")
    return _server["rref"]


class ParameterServer:
    """Model, optimizer, lock and record shared by both designs; subclasses define `push`."""

    def __init__(self, trainers, hidden, depth, lr, snapshot_every, codec=None, seed=0):
        torch.manual_seed(seed)
        self.model, self.codec = mlp(hidden, depth), codec
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.lock = threading.Lock()
        self.trainers, self.live, self.finished_by = list(trainers), set(trainers), set()
        self.over = torch.futures.Future()  # completed when every live trainer has finished
        self.version, self.samples, self.snapshot_every = 0, 0, snapshot_every
        self.snapshots, self.staleness, self.events = [], [], []
        self.start = time.perf_counter()
        self._snapshot()

    def parameters(self):
        return [p.detach().clone() for p in self.model.parameters()]

    def current(self):
        with self.lock:
            return self.parameters(), self.version

    def _apply(self, grads, samples):  # caller holds the lock
        for p, g in zip(self.model.parameters(), grads):
            p.grad = g
        self.optimizer.step()
        self.version += 1
        self.samples += samples
        if self.version % self.snapshot_every == 0:
            self._snapshot()

    def _snapshot(self):
        self.snapshots.append({"update": self.version, "time": time.perf_counter() - self.start,
                               "samples": self.samples, "params": self.parameters()})

    def _trainer_gone(self, name, why):  # caller holds the lock; subclasses may react too
        self.live.discard(name)
        self.events.append({"time": time.perf_counter() - self.start, "update": self.version, "trainer": name,
                            "what": why})

    @staticmethod
    @rpc.functions.async_execution
    def finished(ps_rref, name):
        self = ps_rref.local_value()
        with self.lock:
            self.finished_by.add(name)
            self._check_over()
        return self.over

    def _check_over(self):  # caller holds the lock
        if self.live <= self.finished_by and not self.over.done():
            self.over.set_result(self.version)

    def watch(self, every=0.5, ping_timeout=10):
        """Until the run is over: ping each live trainer that has not finished; an error means it is gone."""
        while not self.over.done():
            time.sleep(every)
            with self.lock:
                waiting_for = sorted(self.live - self.finished_by)
            for name in waiting_for:
                try:
                    rpc.rpc_sync(name, os.getpid, timeout=ping_timeout)
                except RuntimeError as exc:
                    with self.lock:
                        self._trainer_gone(name, f"ping failed: {str(exc).splitlines()[0][:120]}")
                        self._check_over()


class SyncParameterServer(ParameterServer):
    """Waits for one gradient from every live trainer, averages, steps once, answers them all."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.arrived = {}
        self.reply = torch.futures.Future()

    @staticmethod
    @rpc.functions.async_execution
    def push(ps_rref, name, payload, version, samples):
        self = ps_rref.local_value()
        grads = self.codec.decode(payload) if self.codec else payload
        with self.lock:
            reply = self.reply
            self.arrived[name] = (grads, samples)
            self.staleness.append(self.version - version)  # always 0: everyone waits for the round
            self._maybe_step()
        return reply  # completes when the round does

    def _maybe_step(self):  # caller holds the lock
        if not self.arrived or not self.live <= set(self.arrived):
            return
        names = [n for n in self.trainers if n in self.arrived]  # a fixed order: the same rounding every run
        grads = [torch.stack(gs).mean(dim=0) for gs in zip(*(self.arrived[n][0] for n in names))]
        self._apply(grads, sum(self.arrived[n][1] for n in names))
        self.arrived = {}
        reply, self.reply = self.reply, torch.futures.Future()
        reply.set_result((self.parameters(), self.version))

    def _trainer_gone(self, name, why):
        super()._trainer_gone(name, why)
        self._maybe_step()  # the round no longer waits for the trainer that is gone


class AsyncParameterServer(ParameterServer):
    """Applies every gradient the moment it arrives and records how stale it was."""

    @staticmethod
    def push(ps_rref, name, payload, version, samples):
        self = ps_rref.local_value()
        grads = self.codec.decode(payload) if self.codec else payload
        with self.lock:
            self.staleness.append(self.version - version)
            self._apply(grads, samples)
            return self.parameters(), self.version


def shard_batches(x, y, index, n_shards, batch_size, seed=0):
    """Endless batches of shard `index` of (x, y), reshuffled every epoch."""
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, num_replicas=n_shards, rank=index, shuffle=True, seed=seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield from loader


def train_against(ps_rref, push, index, n_trainers, steps, batch_size, hidden, depth, train, codec, die_after):
    name = rpc.get_worker_info().name
    model = mlp(hidden, depth)
    params, version = ps_rref.rpc_sync().current()
    batches = shard_batches(*train, index, n_trainers, batch_size)
    losses, sent = [], []
    for step in range(steps):
        if step == die_after:
            os._exit(1)  # a crash: no exception, no goodbye; the process is simply gone
        with torch.no_grad():
            for p, value in zip(model.parameters(), params):
                p.copy_(value)
        x, y = next(batches)
        loss = F.cross_entropy(model(x), y)
        grads = torch.autograd.grad(loss, list(model.parameters()))
        payload = codec.encode(grads) if codec else grads
        sent.append(codec.nbytes(payload) if codec else sum(g.numel() * g.element_size() for g in grads))
        params, version = rpc.rpc_sync(ps_rref.owner(), push, args=(ps_rref, name, payload, version, len(y)))
        losses.append(loss.item())
    return {"losses": losses, "sent": sent}


def ps_job(design, steps, batch_size, hidden, depth, lr, train, test, codec=None, die=None, die_after=None,
           rpc_timeout=60, shutdown_timeout=20):
    serve_by_name(server_rref, ParameterServer, SyncParameterServer, AsyncParameterServer)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    name = "ps" if rank == 0 else f"trainer{rank}"
    if name == "ps":
        _server["ready"] = threading.Event()  # before init_rpc: no trainer can ask for the server earlier
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=rpc_options(rpc_timeout))
    trainers = [f"trainer{r}" for r in range(1, world)]
    record = None
    if name == "ps":
        every = max(1, steps // 12) * (1 if design == "sync" else len(trainers))  # same samples between snapshots
        server_class = SyncParameterServer if design == "sync" else AsyncParameterServer
        server = server_class(trainers, hidden, depth, lr, snapshot_every=every, codec=codec)
        _server["rref"] = RRef(server)
        _server["ready"].set()
        server.watch()
        record = {"wall": time.perf_counter() - server.start, "updates": server.version,
                  "samples": server.samples, "staleness": server.staleness, "events": server.events}
    else:
        ps_rref = rpc.rpc_sync("ps", server_rref)
        push = SyncParameterServer.push if design == "sync" else AsyncParameterServer.push
        record = train_against(ps_rref, push, rank - 1, len(trainers), steps, batch_size, hidden, depth, train,
                               codec, die_after if name == die else None)
        rpc.rpc_sync("ps", ParameterServer.finished, args=(ps_rref, name), timeout=0)  # 0: no limit; the
        # run ends when every live trainer has finished, and the launch timeout bounds it
    try:
        rpc.shutdown(graceful=True, timeout=shutdown_timeout)
        record["shutdown"] = "clean"
    except RuntimeError as exc:  # a graceful shutdown needs every worker; a dead one makes it fail, not hang
        record["shutdown"] = str(exc).splitlines()[0][:200]
    if name == "ps":  # after shutdown: evaluation needs no RPC and must not delay the other workers
        model = mlp(hidden, depth)
        record["curve"] = []
        for snap in server.snapshots:
            with torch.no_grad():
                for p, value in zip(model.parameters(), snap["params"]):
                    p.copy_(value)
                loss = F.cross_entropy(model(test[0]), test[1]).item()
            record["curve"].append({k: snap[k] for k in ("update", "time", "samples")} |
                                   {"accuracy": accuracy(model, *test), "loss": loss})
        record["params"] = server.parameters()
    return record


def clustered_data(n, seed=0, n_in=64, n_classes=10):
    """A stand-in data set shaped like the digits (64 features in [0, 1], 10 classes): noisy points around one
    random centre per class; 80% train, 20% test. Replace it with yours."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.rand(n_classes, n_in, generator=g)
    y = torch.randint(0, n_classes, (n,), generator=g)
    x = (centres[y] + 0.3 * torch.randn(n, n_in, generator=g)).clamp(0, 1)
    cut = int(0.8 * n)
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--design", choices=["sync", "async"], default="sync")
    parser.add_argument("--steps", type=int, default=240, help="gradients each trainer computes")
    parser.add_argument("--batch", type=int, default=32, help="samples per gradient")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.3)
    parser.add_argument("--samples", type=int, default=4000, help="size of the stand-in data set")
    args = parser.parse_args()
    train, test = clustered_data(args.samples)
    record = ps_job(args.design, args.steps, args.batch, args.hidden, args.depth, args.lr, train, test)
    gc.collect()  # ps_job has shut RPC down; what it built is freed before the interpreter exits
    if int(os.environ["RANK"]) == 0:
        trainers = int(os.environ["WORLD_SIZE"]) - 1
        print(f"summary: {args.design} parameter server, {trainers} trainers, {record['updates']} updates, "
              f"{record['samples'] / record['wall']:.0f} samples/s, test accuracy "
              f"{record['curve'][0]['accuracy']:.3f} -> {record['curve'][-1]['accuracy']:.3f}, "
              f"shutdown {record['shutdown']}", flush=True)

if __name__ == "__main__":
    main()
