"""Checks made before anything is submitted. Each failure is one UsageError naming the problem."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.backends.base import DEPENDENCY_KINDS
from orchestrator.errors import UsageError
from orchestrator.slurm.directives import parse_signal
from orchestrator.slurm.partitions import parse_gpus
from orchestrator.slurm.time_limit import parse_time_minutes

if TYPE_CHECKING:
    from orchestrator.recipe import RecipeSettings

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
class JobResources:
    """What one job asks of the machines, typed once: from a YAML recipe's settings, from the
    ``#SBATCH`` lines of a .sub, or from submitit's executor parameters. Creating one checks the
    time limit and the signal, whichever backend the job will go to."""

    nodes: int = 1
    tasks_per_node: int = 1
    cpus_per_task: int = 1
    gpus_per_node: int = 0
    time: str | None = None  # SLURM's format (30, 02:00:00, 1-00:00)
    partition: str | None = None
    gpu: str | None = None  # the GPU model a YAML recipe names (a key of contract.gpus)

    def __post_init__(self) -> None:
        if self.time:
            parse_time_minutes(self.time)

    @classmethod
    def from_directives(cls, directives: dict[str, str]) -> JobResources:
        if directives.get("signal"):
            parse_signal(directives["signal"])
        return cls(
            nodes=_positive_int(directives, "nodes"),
            tasks_per_node=_positive_int(directives, "ntasks-per-node"),
            cpus_per_task=_positive_int(directives, "cpus-per-task"),
            gpus_per_node=_gpus_per_node(directives),
            time=directives.get("time") or None,
            partition=directives.get("partition") or None,
        )

    @classmethod
    def from_settings(cls, settings: RecipeSettings) -> JobResources:
        """A YAML recipe's resources, as validated, without reading its rendered script back."""
        return cls(
            nodes=settings.nodes,
            tasks_per_node=settings.tasks_per_node,
            cpus_per_task=settings.cpus_per_task,
            gpus_per_node=settings.gpus_per_node,
            time=settings.time,
            partition=settings.partition,
            gpu=settings.gpu,
        )

    @classmethod
    def from_executor_params(cls, params: dict[str, Any]) -> JobResources:
        """submitit's executor parameters (SlurmExecutor's names, or LocalExecutor's)."""
        time = params.get("time", params.get("timeout_min"))
        tasks = params.get("ntasks_per_node", params.get("tasks_per_node"))
        return cls(
            nodes=int(params.get("nodes") or 1),
            tasks_per_node=int(tasks or 1),
            cpus_per_task=int(params.get("cpus_per_task") or 1),
            gpus_per_node=int(params.get("gpus_per_node") or 0),
            time=None if time is None else str(time),
            partition=params.get("partition"),
        )


def _positive_int(directives: dict[str, str], name: str) -> int:
    raw = directives.get(name, "")
    if raw == "":
        return 1
    first = raw.split("-")[0]
    if not first.isdigit() or int(first) < 1:
        raise UsageError(f"#SBATCH --{name}={raw}: expected a positive integer")
    return int(first)


def _gpus_per_node(directives: dict[str, str]) -> int:
    if directives.get("gpus-per-node"):
        return int(directives["gpus-per-node"].split(":")[-1])
    if directives.get("gres"):
        return parse_gpus(directives["gres"])
    if directives.get("gpus"):
        return int(directives["gpus"].split(":")[-1])
    return 0


def check_local_resources(resources: JobResources) -> None:
    """The local backends emulate one node with this machine's GPUs."""
    if resources.nodes > 1:
        raise UsageError(
            f"the recipe asks for {resources.nodes} nodes; the local backend runs one node: use "
            "the slurm backend (`orchestrator cluster up` starts a loopback cluster)"
        )
    if resources.gpus_per_node > 0 and not Path("/dev/nvidia0").exists():
        raise UsageError("the recipe asks for GPUs and this machine has none")
