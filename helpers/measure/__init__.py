"""Measuring done right: timing, bandwidth and ceilings, memory, communication logs, disk, claim verdicts."""
