"""The few names the notebooks import: start workers, ask what the machine has, show what was measured."""
from helpers.devices import default_backend, describe_machine, gpu_count, machine_facts, rank_device
from helpers.measure.headline import headline
from helpers.launcher import (ExitHangWarning, LaunchTimeout, WorkerError, Workers, default_world_size, free_port,
                              launch, start_server)
from helpers.launcher.rank import report_progress

__all__ = ["launch", "WorkerError", "LaunchTimeout", "ExitHangWarning", "describe_machine", "machine_facts",
           "gpu_count", "default_backend", "default_world_size", "free_port", "rank_device", "report_progress",
           "headline", "start_server", "Workers"]
