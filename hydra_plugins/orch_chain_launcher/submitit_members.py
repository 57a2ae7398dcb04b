"""hydra-submitit-launcher's launchers, with what a training sweep needs on top.

Before submitting, every member's config passes the trainer's checks for the member's rank count
(nodes x tasks_per_node), and each member gets ``run_dir=<sweep dir>/<job num>`` and a seed of its
own (derived from ``base_seed``, or fresh) unless the sweep sets them. In the job, the trainer's
final ``sys.exit(0)`` is turned into a return so that submitit records the member's result.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn
from hydra.types import HydraContext, TaskFunction
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher
from omegaconf import DictConfig

from hydra_plugins.orch_chain_launcher.members import (
    ExitStatusAsResult,
    fail,
    validate_members,
    with_run_dir_and_seed,
)
from orchestrator.errors import UsageError


class _MembersMixin:
    """Shared by the SLURM and local variants; ``base_seed`` is ours, not an executor setting."""

    def __init__(self, base_seed: int | None = None, **params: Any) -> None:
        self.base_seed = base_seed
        super().__init__(**params)  # type: ignore[call-arg]

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        super().setup(  # type: ignore[misc]
            hydra_context=hydra_context,
            task_function=ExitStatusAsResult(task_function),
            config=config,
        )

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()  # type: ignore[attr-defined]
        world_size = int(self.params["nodes"]) * int(self.params["tasks_per_node"])  # type: ignore[attr-defined]
        try:
            members = with_run_dir_and_seed(
                job_overrides, initial_job_idx, sweep_dir, self.base_seed
            )
            validate_members(
                self.hydra_context,  # type: ignore[attr-defined]
                self.config,  # type: ignore[attr-defined]
                members,
                initial_job_idx,
                world_size,
            )
        except UsageError as error:
            fail(error)
        return super().launch(members, initial_job_idx)  # type: ignore[misc]


class SlurmMembersLauncher(_MembersMixin, SlurmLauncher):
    pass


class LocalMembersLauncher(_MembersMixin, LocalLauncher):
    pass
