"""Start worker processes from a kernel, supervise them, and bring back what each rank returned or raised.

A map, for reading the package in the order a call travels (each hop's module and entry point; two hops cross a
`python -c` string, the fork-server's boot and a spawned worker's, which no import follows):

The way out, from a cell to N processes running its function
    cell         `launch(fn, *args)`, or `Workers(n).run(fn)` for ranks kept between cells   api.launch, workers.Workers
    plan         the options checked, the environments fixed, a free port        api.LaunchPlan.make
    run folder   fn and its arguments by value, the kernel's state               run_folder.write_launch
    fork-server  one fork per rank, its pipes attached (`python -c` boot)        server.ForkServer.fork
                 or, start_method="spawn", a fresh interpreter (`python -c`)     spawn.SpawnedWorker
    worker       its own session, torchrun's environment, the kernel's state     worker.run_worker
    function     called, its locals kept until its outcome is written            worker.call_and_write
The way back, from a rank that raised to the exception in the cell
    error file   error.<rank> (or result.<rank>), written whole                  run_folder.write_error
    progress     "reported" on the rank's progress pipe; then it exits           progress.report_outcome
    supervision  one selector over every pipe, exit notice and deadline          supervise.Supervision.watch
    root cause   the earliest failure that is not a peer's reaction              errors.root_cause
    exception    WorkerError (or LaunchTimeout, with each rank's stack)          supervise.Outcome.values
The three channels between the kernel and its ranks
    the run folder's files      payload, the kernel's state, outcomes, stacks, rendezvous stores    run_folder.rank_file
    per-rank pipes              stdout and stderr, shown live and rank-prefixed                      output.RankStream
                                progress and notices (reported, call done)                          progress.parse_line
                                `Workers`' calls, one command pipe per rank                          workers.serve_calls
    the fork-server's socket    fork requests with the pipes attached, exit notices back             server.serve
Beside the path
    nothing outlives a launch: sessions, subreapers, a last sweep        sessions.stop_sessions
    env:// answered by a file store in the run folder, loopback only     rendezvous.install

torchrun's own agents (a script under torchrun, several agents as nodes) are `helpers.cluster`'s: they start
torchrun, which starts the ranks.
"""
from helpers.launcher.api import default_world_size, free_port, launch
from helpers.launcher.errors import ExitHangWarning, LaunchTimeout, RankFailure, WorkerError, root_cause
from helpers.launcher.server import start_server, stop_server
from helpers.launcher.workers import Workers, WorkersStopped

__all__ = ["launch", "WorkerError", "LaunchTimeout", "ExitHangWarning", "RankFailure", "root_cause",
           "default_world_size", "free_port", "start_server", "stop_server", "Workers", "WorkersStopped"]
