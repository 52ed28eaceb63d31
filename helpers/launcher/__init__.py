"""Start worker processes from a kernel, supervise them, and bring back what each rank returned or raised.

A map, for reading the package in the order a call travels (each hop's module and entry point; two hops cross a
`python -c` string, the fork-server's boot and a spawned worker's, which no import follows):

The way out, from a cell to N processes running its function
    cell         `launch(fn, *args)`, or `Workers(n).run(fn)` for ranks kept between cells   api.launch, workers.Workers
    plan         the options checked, the environments fixed, a free port        api.LaunchPlan.make
    run folder   fn and its arguments by value, the kernel's state               run_folder.write_launch
    fork-server  one fork per rank, its pipes attached (`python -c` boot)        server.ForkServer.fork
                 its own loop: a Fork request in, a fork and a Forked reply out  server_loop.serve
                 or, start_method="spawn", a fresh interpreter (`python -c`)     spawn.SpawnedWorker
    rank         its own session, torchrun's environment, the kernel's state     rank.run_worker
    function     called, its locals kept until its outcome is written            rank.call_and_write
The way back, from a rank that raised to the exception in the cell
    error file   error.<rank> (or result.<rank>), written whole                  run_folder.write_error
    notice       Reported on the rank's progress pipe; then it exits             protocol.Reported
    supervision  one selector over every pipe, exit notice and deadline          supervise.Supervision.watch
    root cause   the earliest failure that is not a peer's reaction              errors.root_cause
    exception    WorkerError (or LaunchTimeout, with each rank's stack)          supervise.Outcome.values
The channels between the kernel and its ranks (each message on a pipe or the socket: a class in `protocol`)
    the run folder's files      payload, kernel's state, outcomes, stacks, rendezvous stores   run_folder.rank_file
                                a rank writes its stack on this signal (a timeout)             run_folder.STACK_SIGNAL
    per-rank pipes              stdout and stderr, shown live and rank-prefixed                output.RankStream
                                notices (Progress, Reported, CallDone), read by the kernel     protocol.NoticeReader
                                Progress, drawn per rank in the cell                           progress.ProgressDisplay
                                `Workers`' calls, a command pipe per rank, served by it        rank.serve_calls
    the fork-server's socket    Fork requests, pipes attached; Ready, Forked, Exited back      protocol.decode
Beside the path
    nothing outlives a launch: sessions, subreapers, a last sweep        sessions.stop_sessions
    env:// answered by a file store in the run folder, loopback only     rendezvous.install

Which process runs each module. A module imports only from its own side and the shared one, except that the
fork-server's loop imports the rank's side, which each of its forks becomes (`tests/project/test_package_maps.py`
checks it):
    kernel       api supervise output progress workers server spawn
    fork-server  server_loop
    rank         rank
    shared       protocol run_folder errors sessions rendezvous

torchrun's own agents (a script under torchrun, several agents as nodes) are `helpers.cluster`'s: they start
torchrun, which starts the ranks.
"""
from helpers.launcher.api import default_world_size, free_port, launch
from helpers.launcher.errors import ExitHangWarning, LaunchTimeout, RankFailure, WorkerError, root_cause
from helpers.launcher.server import start_server, stop_server
from helpers.launcher.workers import Workers, WorkersStopped

__all__ = ["launch", "WorkerError", "LaunchTimeout", "ExitHangWarning", "RankFailure", "root_cause",
           "default_world_size", "free_port", "start_server", "stop_server", "Workers", "WorkersStopped"]
