"""The SLURM cluster a bench runs on: the one $SLURM_CONF names, else a private loopback cluster
started for the bench and stopped after it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from orchestrator.cluster.lifecycle import down, up


@contextmanager
def bench_cluster(
    work: Path,
    nodes: int | None = None,
    cpus_per_node: int | None = None,
    preemption: bool = False,
) -> Iterator[str]:
    """Yield the slurm.conf to use, with SLURM_CONF set to it in this process."""
    if "SLURM_CONF" in os.environ:
        yield os.environ["SLURM_CONF"]
        return
    directory = work / "cluster"
    print(f"starting a loopback cluster in {directory}", flush=True)
    info = up(directory, nodes=nodes, cpus_per_node=cpus_per_node, preemption=preemption)
    os.environ["SLURM_CONF"] = info.conf
    try:
        yield info.conf
    finally:
        os.environ.pop("SLURM_CONF", None)
        down(directory)
