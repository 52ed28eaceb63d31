"""Where the measuring modules used to find the verdict and the noise of a median; both live in
`helpers.measure.advice` now (the appendix "Common advice, measured" owns the verdict's rule and wording).

Kept only so that the modules that still import from here (collectives, ddp, disk, fsdp_bench, parameter_server,
precision) keep working until they import `helpers.measure.advice`; it defines nothing of its own.
"""
from helpers.measure.advice import claim_text, median_interval, verdict

__all__ = ["claim_text", "median_interval", "verdict"]
