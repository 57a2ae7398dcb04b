"""SLURM partitions as sinfo describes them, and whether a job's typed resources fit one."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

from orchestrator.errors import UsageError
from orchestrator.slurm.resources import JobResources, parse_gpu_type, parse_gpus
from orchestrator.slurm.time_limit import parse_time_minutes

# sinfo's columns, in the order parse_partitions reads them.
PARTITION_FORMAT = "%P|%a|%D|%c|%G|%l|%m"


@dataclass(frozen=True)
class Partition:
    name: str
    is_default: bool
    state: str  # sinfo's %a: up, down, drain or inact
    nodes: int
    cpus_per_node: int
    gpus_per_node: int
    max_time_min: float | None
    memory_mb: int = 0  # sinfo's %m: RealMemory per node (1: not configured)
    gpu_type: str | None = None  # from the GRES, e.g. h100 in gpu:h100:8

    @property
    def available(self) -> bool:
        return self.state == "up"


def _leading_int(text: str) -> int:
    match = re.match(r"\d+", text)
    return int(match.group()) if match else 0


def parse_partitions(output: str) -> list[Partition]:
    """Partitions from sinfo's table in PARTITION_FORMAT (a partition listed on several lines,
    one per node state, adds up its nodes)."""
    partitions: dict[str, Partition] = {}
    for line in output.splitlines():
        name, avail, nodes, cpus, gres, limit, memory = line.split("|")
        is_default = name.endswith("*")
        name = name.rstrip("*")
        previous = partitions.get(name)
        count = int(nodes) + (previous.nodes if previous else 0)
        partitions[name] = Partition(
            name=name,
            is_default=is_default,
            state=avail,
            nodes=count,
            cpus_per_node=_leading_int(cpus),
            gpus_per_node=parse_gpus(gres),
            max_time_min=parse_time_minutes(limit) if limit not in ("", "n/a") else None,
            memory_mb=_leading_int(memory),
            gpu_type=parse_gpu_type(gres),
        )
    return list(partitions.values())


def target_partition(name: str | None, partitions: list[Partition]) -> Partition | None:
    """The partition a job goes to: the one it names, else the cluster's default."""
    for partition in partitions:
        if (name and partition.name == name) or (not name and partition.is_default):
            return partition
    return None


def check_partition(resources: JobResources, partitions: list[Partition]) -> Partition:
    """The job's request must fit a partition that exists (one that is not up only warns)."""
    partition = target_partition(resources.partition, partitions)
    if partition is None and resources.partition:
        names = ", ".join(p.name for p in partitions) or "none"
        raise UsageError(f"partition {resources.partition!r} does not exist (partitions: {names})")
    if partition is None:
        raise UsageError("no --partition given and the cluster has no default partition")
    if not partition.available:
        # sbatch queues jobs for a partition in maintenance: they pend until it is up again.
        print(
            f"warning: partition {partition.name!r} is {partition.state}: the jobs will pend "
            "until it is up",
            file=sys.stderr,
            flush=True,
        )
    if resources.allocated > partition.nodes:
        raise UsageError(
            f"{resources.allocated} nodes asked; partition {partition.name!r} has {partition.nodes}"
        )
    cpus = resources.tasks_per_node * resources.cpus_per_task
    if cpus > partition.cpus_per_node:
        raise UsageError(
            f"{resources.tasks_per_node} tasks x {resources.cpus_per_task} CPUs per node asked; "
            f"nodes of partition {partition.name!r} have {partition.cpus_per_node} CPUs"
        )
    if resources.gpus_per_node > partition.gpus_per_node:
        raise UsageError(
            f"{resources.gpus_per_node} GPUs per node asked; nodes of partition "
            f"{partition.name!r} have {partition.gpus_per_node}"
        )
    limit = partition.max_time_min
    if resources.time and limit is not None:
        minutes = parse_time_minutes(resources.time)
        if minutes is None or minutes > limit:
            raise UsageError(
                f"time limit {resources.time} exceeds partition {partition.name!r}'s "
                f"maximum of {limit:g} minutes"
            )
    return partition
