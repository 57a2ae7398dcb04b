"""What one job asks of the machines, typed once whatever the recipe's kind, and SLURM's GRES
strings (``gpu:h100:8``) that both sbatch and sinfo write."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orchestrator.errors import UsageError
from orchestrator.slurm.directives import parse_signal
from orchestrator.slurm.time_limit import parse_time_minutes

if TYPE_CHECKING:
    from orchestrator.recipe import RecipeSettings


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


@dataclass(frozen=True)
class JobResources:
    """What one job asks of the machines, typed once: from a YAML recipe's settings, from the
    ``#SBATCH`` lines of a .sub, or from submitit's executor parameters. Creating one checks the
    time limit and the signal, whichever backend the job will go to."""

    nodes: int = 1  # the training's
    tasks_per_node: int = 1
    cpus_per_task: int = 1
    gpus_per_node: int = 0
    time: str | None = None  # SLURM's format (30, 02:00:00, 1-00:00)
    partition: str | None = None
    gpu: str | None = None  # the GPU model a YAML recipe names (a key of contract.gpus)
    spare_nodes: int = 0  # allocated besides (a YAML recipe's spare_nodes)

    @property
    def allocated(self) -> int:
        """The nodes the job asks SLURM for: the training's and the spares."""
        return self.nodes + self.spare_nodes

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
            spare_nodes=settings.spare_nodes,
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
