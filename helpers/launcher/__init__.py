"""Start worker processes from a kernel and supervise them: launch, its errors, torchrun, progress, rendezvous."""
from helpers.launcher.api import (ExitHangWarning, LaunchTimeout, RankFailure, WorkerError, default_world_size,
                                  free_port, launch, root_cause)

__all__ = ["launch", "WorkerError", "LaunchTimeout", "ExitHangWarning", "RankFailure", "root_cause",
           "default_world_size", "free_port"]
