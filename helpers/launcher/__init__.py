"""Start worker processes from a kernel and supervise them: launch, its errors, the fork-server, torchrun."""
from helpers.launcher.api import default_world_size, free_port, launch
from helpers.launcher.errors import ExitHangWarning, LaunchTimeout, RankFailure, WorkerError, root_cause
from helpers.launcher.server import start_server, stop_server
from helpers.launcher.workers import Workers, WorkersStopped

__all__ = ["launch", "WorkerError", "LaunchTimeout", "ExitHangWarning", "RankFailure", "root_cause",
           "default_world_size", "free_port", "start_server", "stop_server", "Workers", "WorkersStopped"]
