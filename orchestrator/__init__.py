"""Chained SLURM launches with per-job seeds, a loopback test cluster, and the tools around them."""

__version__ = "0.1.0"
