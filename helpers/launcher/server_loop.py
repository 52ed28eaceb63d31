"""The fork-server's own loop: the process `server.ForkServer` starts, which forks a worker per request.

It runs in the server process only (a `python -c` boot, which no import follows, starts it), so it may import the
rank's side, `rank.run_worker`, that each fork becomes; `server` says why the launcher has a server at all. It
imports what the workers need once (PRELOAD), answers each `protocol.Fork` with a fork and a `Forked`, reaps its
children and reports each exit as an `Exited`, and when the kernel's end of the socket closes it kills every worker's
session and exits.
"""
from __future__ import annotations

import os
import select
import signal
import socket
import time

from helpers.launcher import sessions
from helpers.launcher.protocol import MAX_FDS, MESSAGE_BYTES, Exited, Fork, Forked, Ready, decode, encode
from helpers.launcher.rank import run_worker

# Imported once in the server, so a forked worker finds them already loaded. Importing runs no torch op and
# starts no thread (checked by a test that reads /proc/<server pid>/task).
PRELOAD = ("numpy", "torch", "torch.distributed", "torch.nn.parallel", "torch.distributed.fsdp",
           "torch.distributed.tensor", "torch.distributed.checkpoint", "cloudpickle", "helpers.launcher.rank")


def _send(sock: socket.socket, message) -> None:
    try:
        sock.send(encode(message))
    except OSError:  # the kernel is gone: the main loop sees it next
        pass


def serve(fd: int) -> None:
    """The server's main loop: fork on request, report exits, and end everything when the kernel goes."""
    sock = socket.socket(fileno=fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the kernel's interrupts are for the kernel
    sessions.become_subreaper()  # what a killed worker started comes here, not to init, and is ended (_reap)
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so SIGCHLD reaches the wakeup fd
    children: dict[int, tuple[str, int]] = {}
    _send(sock, Ready(os.getpid(), len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None))
    while True:
        try:
            readable, _, _ = select.select([sock, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in readable:
            try:
                while os.read(wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
            _reap(sock, children)
        if sock in readable:
            try:
                data, fds, _, _ = socket.recv_fds(sock, MESSAGE_BYTES, MAX_FDS)
            except OSError:
                data, fds = b"", []
            if not data:
                _end(children)
            request = decode(data, (Fork,))
            pid = _fork_worker(request, fds, sock, (wake_r, wake_w))
            children[pid] = (request.run_dir, request.rank)
            _send(sock, Forked(request.run_dir, request.rank, pid))


def _reap(sock: socket.socket, children: dict) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            break
        if children.pop(pid, None) is not None:  # not an adopted orphan: a worker, whose exit the kernel awaits
            _send(sock, Exited(pid, os.waitstatus_to_exitcode(status)))
    sessions.kill_orphans(set(children))  # a worker that died left them; their own exits come back here


def _end(children: dict) -> None:
    """The kernel closed its end (or died): no worker may outlive it."""
    for pid in children:
        sessions.signal_session(pid, signal.SIGKILL)
    sessions.kill_orphans(set(children))
    deadline = time.monotonic() + 5
    while children and time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid:
            children.pop(pid, None)
        else:
            time.sleep(0.01)
    os._exit(0)


def _fork_worker(request: Fork, fds: list[int], sock: socket.socket, wake: tuple[int, int]) -> int:
    server_pid = os.getpid()
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        return pid
    try:  # the child: shed the server's machinery, then become the worker
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        sock.close()
        for fd in wake:
            os.close(fd)
        out, err, progress, *command = fds
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        run_worker(request.run_dir, request.rank, parent_pid=server_pid, progress_fd=progress,
                   command_fd=command[0] if command else None)
    finally:
        os._exit(1)
