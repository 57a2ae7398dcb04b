"""Checks made before anything is submitted. Each failure is one UsageError naming the problem."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from orchestrator.backends.base import DEPENDENCY_KINDS
from orchestrator.errors import UsageError
from orchestrator.sbatch_directives import parse_signal
from orchestrator.slurm_time import parse_time_minutes

MAX_CHAIN_LENGTH = 1000


def check_num_jobs(num_jobs: int) -> None:
    if num_jobs < 1:
        raise UsageError(f"-n {num_jobs}: a chain needs at least 1 job")
    if num_jobs > MAX_CHAIN_LENGTH:
        raise UsageError(f"-n {num_jobs}: more than {MAX_CHAIN_LENGTH} jobs in one chain")


def check_dependency(kind: str) -> None:
    if kind not in DEPENDENCY_KINDS:
        raise UsageError(f"--dependency {kind!r}: choose one of {', '.join(DEPENDENCY_KINDS)}")


def check_job_name(name: str) -> None:
    """SLURM job names, log and script file names are made from it: keep it plain."""
    if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise UsageError(f"job name {name!r}: use letters, digits, '-', '_' and '.' only")


def check_run_dir(run_dir: Path) -> None:
    """The run dir (or the nearest folder that exists above it) must be a writable directory."""
    if "," in str(run_dir):
        raise UsageError(f"run dir {run_dir}: a ',' cannot pass through sbatch --export; rename it")
    if run_dir.exists() and not run_dir.is_dir():
        raise UsageError(f"run dir {run_dir} exists and is not a directory")
    existing = run_dir
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(
            f"run dir {run_dir}: {existing} is not writable; choose --run-dir elsewhere"
        )


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


def parse_gpus(gres: str) -> int:
    """GPUs per node from sinfo's %G (``gpu:8``, ``gpu:a100:4(S:0-1)``, ``(null)``)."""
    total = 0
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def parse_gpu_type(gres: str) -> str | None:
    """The GPU type named in sinfo's %G (``gpu:h100:8`` -> h100), if any."""
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and len(parts) == 3:
            return parts[1].lower()
    return None


def parse_partitions(output: str) -> list[Partition]:
    """Partitions from sinfo's table in slurm_commands.PARTITION_FORMAT."""
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
            cpus_per_node=int(re.match(r"\d+", cpus).group()) if re.match(r"\d+", cpus) else 0,
            gpus_per_node=parse_gpus(gres),
            max_time_min=parse_time_minutes(limit) if limit not in ("", "n/a") else None,
            memory_mb=int(re.match(r"\d+", memory).group()) if re.match(r"\d+", memory) else 0,
            gpu_type=parse_gpu_type(gres),
        )
    return list(partitions.values())


def positive_int(directives: dict[str, str], name: str, default: int) -> int:
    raw = directives.get(name, "")
    if raw == "":
        return default
    first = raw.split("-")[0]
    if not first.isdigit() or int(first) < 1:
        raise UsageError(f"#SBATCH --{name}={raw}: expected a positive integer")
    return int(first)


def requested_gpus_per_node(directives: dict[str, str]) -> int:
    if directives.get("gpus-per-node"):
        return int(directives["gpus-per-node"].split(":")[-1])
    if directives.get("gres"):
        return parse_gpus(directives["gres"])
    if directives.get("gpus"):
        return int(directives["gpus"].split(":")[-1])
    return 0


def check_resources(directives: dict[str, str], partitions: list[Partition]) -> Partition:
    """The script's #SBATCH request must fit a partition that exists (one that is not up only
    warns)."""
    if directives.get("signal"):
        parse_signal(directives["signal"])
    wanted = directives.get("partition", "")
    if wanted:
        matches = [p for p in partitions if p.name == wanted]
        if not matches:
            names = ", ".join(p.name for p in partitions) or "none"
            raise UsageError(f"partition {wanted!r} does not exist (partitions: {names})")
        partition = matches[0]
    else:
        defaults = [p for p in partitions if p.is_default]
        if not defaults:
            raise UsageError("no --partition given and the cluster has no default partition")
        partition = defaults[0]
    if not partition.available:
        # sbatch queues jobs for a partition in maintenance: they pend until it is up again.
        print(
            f"warning: partition {partition.name!r} is {partition.state}: the jobs will pend "
            "until it is up",
            file=sys.stderr,
            flush=True,
        )
    nodes = positive_int(directives, "nodes", 1)
    if nodes > partition.nodes:
        raise UsageError(f"{nodes} nodes asked; partition {partition.name!r} has {partition.nodes}")
    tasks_per_node = positive_int(directives, "ntasks-per-node", 1)
    cpus_per_task = positive_int(directives, "cpus-per-task", 1)
    if tasks_per_node * cpus_per_task > partition.cpus_per_node:
        raise UsageError(
            f"{tasks_per_node} tasks x {cpus_per_task} CPUs per node asked; nodes of partition "
            f"{partition.name!r} have {partition.cpus_per_node} CPUs"
        )
    gpus = requested_gpus_per_node(directives)
    if gpus > partition.gpus_per_node:
        raise UsageError(
            f"{gpus} GPUs per node asked; nodes of partition {partition.name!r} have "
            f"{partition.gpus_per_node}"
        )
    if directives.get("time"):
        minutes = parse_time_minutes(directives["time"])
        limit = partition.max_time_min
        if limit is not None and (minutes is None or minutes > limit):
            raise UsageError(
                f"time limit {directives['time']} exceeds partition {partition.name!r}'s "
                f"maximum of {limit:g} minutes"
            )
    return partition


def check_local_resources(directives: dict[str, str]) -> None:
    """The local backend emulates one node with this machine's GPUs (none here)."""
    nodes = positive_int(directives, "nodes", 1)
    if nodes > 1:
        raise UsageError(
            f"the recipe asks for {nodes} nodes; the local backend runs one node: use the slurm "
            "backend (`orchestrator cluster up` starts a loopback cluster)"
        )
    if requested_gpus_per_node(directives) > 0 and not Path("/dev/nvidia0").exists():
        raise UsageError("the recipe asks for GPUs and this machine has none")
    if directives.get("time"):
        parse_time_minutes(directives["time"])
    if directives.get("signal"):
        parse_signal(directives["signal"])


def check_fits(directives: dict[str, str], sinfo_table: str | None, runs_here: bool) -> None:
    """Preflight, part two: the request must fit the machines the chosen backend will use."""
    if sinfo_table is None or runs_here:
        check_local_resources(directives)
    else:
        check_resources(directives, parse_partitions(sinfo_table))
