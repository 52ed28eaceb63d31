# From the PyTorch distributed cookbook: notebooks/04_rpc_parameter_server.ipynb, the cells tagged 'script:rpc_parameter_server.py'.
# In the cookbook `./cookbook export` writes this file from those cells: edit the cells there.
# Copied into your project, it is yours to edit.
# Run: torchrun --standalone --nproc-per-node=2 rpc_parameter_server.py --help
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
import threading
import time
import warnings

import torch
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def start_rpc(rpc_timeout=60):
    """Join the RPC group with torchrun's variables; rank 0 is `ps`, rank r is `trainer{r}`. With more processes
    than cores, TCP only: the shared-memory transport busy-polls the cores the trainers need."""
    warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*")  # init_rpc's internal gloo group
    logging.getLogger("torch.distributed.rpc.api").setLevel(logging.CRITICAL)  # a failed shutdown: we report it
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # `_transports` is private: no public option chooses TensorPipe's transport. It is passed only where the
    # shared-memory one would starve the ranks (more processes than cores); drop it where each has a core.
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=rpc_timeout,
                                              **({"_transports": ["uv"]} if world > cores else {}))
    name = "ps" if rank == 0 else f"trainer{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=options)
    return name


def mlp(hidden, depth, seed=0, n_in=64, n_classes=10):
    """Notebook 02's DigitsMLP as plain layers: [0] the body (`depth` hidden ReLU layers), [1] the linear head.
    Seeded: every process that builds one starts from the same values."""
    torch.manual_seed(seed)
    layers, width = [], n_in
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    return nn.Sequential(nn.Sequential(*layers), nn.Linear(width, n_classes))


def load(model, params):
    with torch.no_grad():
        for p, value in zip(model.parameters(), params):
            p.copy_(value)
    return model


def evaluate(model, x, y):
    with torch.no_grad():
        logits = model(x)
    return {"accuracy": (logits.argmax(dim=1) == y).float().mean().item(), "loss": F.cross_entropy(logits, y).item()}


_server = {}  # on ps: the ParameterServer, made before init_rpc so that it exists before any trainer asks for it


def the_server():
    """Runs on ps, called by a trainer's `rpc.remote`: the RRef it gets refers to this object, which stays here."""
    return _server["ps"]


class ParameterServer:
    """Model and optimizer on ps. Synchronous: wait for a gradient from every live trainer, average them, step once
    and answer all of them with the new parameters. Asynchronous: step on each gradient the moment it arrives."""

    def __init__(self, sync, trainers, hidden, depth, lr, snapshot_every, codec=None, seed=0):
        self.model, self.sync, self.codec = mlp(hidden, depth, seed), sync, codec
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.lock = threading.Lock()  # RPC calls run concurrently in the server's thread pool
        self.trainers, self.live, self.finished = list(trainers), set(trainers), set()
        self.arrived, self.reply = {}, torch.futures.Future()  # the round in progress, and its answer
        self.over = torch.futures.Future()  # completed when every live trainer has finished
        self.version, self.samples, self.wall, self.snapshot_every = 0, 0, 0.0, snapshot_every
        self.snapshots, self.staleness, self.events = [], [], []
        self.start = time.perf_counter()
        self.snapshot()

    def parameters(self):
        return [p.detach().clone() for p in self.model.parameters()]

    def snapshot(self):  # evaluated after the run: evaluation never slows the run it measures
        self.snapshots.append({"update": self.version, "time": time.perf_counter() - self.start,
                               "samples": self.samples, "params": self.parameters()})

    @rpc.functions.async_execution  # returns a Future: a trainer waiting for its round holds no server thread
    def push(self, name, payload, version, samples):
        grads = self.codec.decode(payload) if self.codec else payload
        with self.lock:
            self.staleness.append(self.version - version)  # always 0 when synchronous: each round waits for all
            reply = self.reply
            self.arrived[name] = (grads, samples)
            self.step_when_ready()
        return reply  # completes with the round

    def step_when_ready(self):  # caller holds the lock
        if not self.arrived or (self.sync and not self.live <= set(self.arrived)):
            return
        names = [n for n in self.trainers if n in self.arrived]  # a fixed order: the same rounding every run
        for p, *grads in zip(self.model.parameters(), *(self.arrived[n][0] for n in names)):
            p.grad = torch.stack(grads).mean(dim=0)
        self.optimizer.step()
        self.version += 1
        self.samples += sum(self.arrived[n][1] for n in names)
        if self.version % self.snapshot_every == 0:
            self.snapshot()
        self.arrived = {}
        reply, self.reply = self.reply, torch.futures.Future()
        reply.set_result((self.parameters(), self.version))

    @rpc.functions.async_execution
    def finish(self, name):  # answered when the run is over: all live processes reach rpc.shutdown together
        with self.lock:
            self.finished.add(name)
            self.wall = time.perf_counter() - self.start  # the run ends when its last trainer finishes
        return self.over


def watch_trainers(server, every=0.2):
    """On ps, once every worker has joined: until every live trainer has finished, ping each one still training.
    A dead one answers with an error at once (its connection is gone); the rounds stop waiting for it."""
    server.start = time.perf_counter()
    while True:
        time.sleep(every)
        with server.lock:
            training = sorted(server.live - server.finished)
        if not training:
            break
        for name in training:
            try:
                rpc.rpc_sync(name, os.getpid, timeout=10)
            except RuntimeError as exc:
                with server.lock:
                    server.live.discard(name)
                    server.events.append({"time": time.perf_counter() - server.start, "update": server.version,
                                          "trainer": name, "what": f"ping failed: {str(exc).splitlines()[0][:120]}"})
                    server.step_when_ready()
    server.over.set_result(server.version)  # every live trainer has finished: answers their `finish`


def shard_batches(x, y, index, n_shards, batch_size, seed=0):
    """Endless batches of shard `index` of (x, y), reshuffled every epoch."""
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, num_replicas=n_shards, rank=index, shuffle=True, seed=seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield from loader


def ps_job(design, steps, batch_size, hidden, depth, lr, train, test, codec=None, die=None, die_after=None,
           rpc_timeout=60, shutdown_timeout=20, log_every=0):
    """Rank 0 serves and returns the run's record; ranks 1..T train and return the bytes of each push."""
    trainers = [f"trainer{r}" for r in range(1, int(os.environ["WORLD_SIZE"]))]
    if os.environ["RANK"] == "0":
        every = max(1, steps // 12) * (1 if design == "sync" else len(trainers))  # same samples between snapshots
        server = _server["ps"] = ParameterServer(design == "sync", trainers, hidden, depth, lr, every, codec)
    name = start_rpc(rpc_timeout)
    if name == "ps":
        watch_trainers(server)
        record = {"wall": server.wall, "updates": server.version, "samples": server.samples,
                  "staleness": server.staleness, "events": server.events}
    else:
        ps_rref = rpc.remote("ps", the_server)
        model, version, record = mlp(hidden, depth), 0, {"sent": []}  # seeded: the server's initial values
        batches = shard_batches(*train, trainers.index(name), len(trainers), batch_size)
        for step in range(steps):
            if name == die and step == die_after:
                os._exit(1)  # a crash: no exception, no goodbye; the process is simply gone
            x, y = next(batches)
            loss = F.cross_entropy(model(x), y)
            grads = torch.autograd.grad(loss, list(model.parameters()))
            payload = codec.encode(grads) if codec else grads
            record["sent"].append(codec.nbytes(payload) if codec else sum(g.numel() * g.element_size() for g in grads))
            params, version = ps_rref.rpc_sync().push(name, payload, version, len(y))  # runs on ps
            load(model, params)
            if log_every and name == trainers[0] and (step + 1) % log_every == 0:
                print(f"{name}: step {step + 1}/{steps}, server version {version}, loss {loss.item():.4f}",
                      flush=True)
        ps_rref.rpc_sync(timeout=0).finish(name)  # 0: no limit; a launch's or a job's own timeout bounds it
    try:
        rpc.shutdown(graceful=True, timeout=shutdown_timeout)
        record["shutdown"] = "clean"
    except RuntimeError as exc:  # a graceful shutdown needs every worker; a dead one makes it fail, not hang
        record["shutdown"] = str(exc).splitlines()[0][:200]
    if name == "ps":  # after shutdown: evaluation needs no RPC and must not delay the other workers
        model = mlp(hidden, depth)
        record["curve"] = [snap | evaluate(load(model, snap.pop("params")), *test) for snap in server.snapshots]
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
    record = ps_job(args.design, args.steps, args.batch, args.hidden, args.depth, args.lr, train, test,
                    log_every=max(1, args.steps // 8))
    gc.collect()  # ps_job has shut RPC down; what it built is freed before the interpreter exits
    if os.environ["RANK"] == "0":
        print(f"summary: {args.design} parameter server, {int(os.environ['WORLD_SIZE']) - 1} trainers, "
              f"{record['updates']} updates, {record['samples'] / record['wall']:.0f} samples/s, test accuracy "
              f"{record['curve'][0]['accuracy']:.3f} -> {record['curve'][-1]['accuracy']:.3f}, "
              f"shutdown {record['shutdown']}", flush=True)

if __name__ == "__main__":
    main()
