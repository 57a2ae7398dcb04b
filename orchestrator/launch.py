"""The one launch path: every front end (``auto_launch``, chained sweeps, ``launch_callable_chain``)
calls ``prepare_launch``, so every one of them runs every check before anything is queued:

probe (one sinfo call, parsed once) -> backend (``--backend``, or auto) -> each job's typed
resources against the partition it goes to, or this machine -> ``--retries`` against the backend
-> the planner's plan check of each training job, on the memory of the partition found above.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.backends import registry
from orchestrator.backends.base import Backend
from orchestrator.errors import UsageError, prefixed
from orchestrator.launch_checks import (
    check_backend_retries,
    check_local_resources,
    check_programs,
)
from orchestrator.slurm.commands import probe_partitions
from orchestrator.slurm.partitions import Partition, check_partition
from orchestrator.slurm.resources import JobResources

if TYPE_CHECKING:
    from orchestrator.chain import ThenJob
    from train.config import TrainConfig


@dataclass(frozen=True)
class LaunchJob:
    """One kind of job a launch queues, as the checks see it.

    ``label`` prefixes its errors (``--then``; None for the chain's own job); ``name``
    names it in plan-check lines (the recipe, a sweep member); ``training`` builds the trainer
    config it will run, for the plan check (None: not a training job, or no plan check);
    ``programs`` are what it starts by name from the PATH (``Recipe.programs``).
    """

    resources: JobResources
    name: str
    label: str | None = None
    training: Callable[[], TrainConfig] | None = None
    programs: tuple[str, ...] = ()


def then_job(then: ThenJob) -> LaunchJob:
    """A --then job as the checks see it: its resources must fit the chain's backend too (an
    evaluation is not priced by the plan check)."""
    return LaunchJob(then.resources, str(then.recipe), label=then.option, programs=then.programs)


@dataclass(frozen=True)
class Site:
    """Where the jobs go: the chosen backend and, when it submits through SLURM, the cluster's
    partitions (None: the jobs run on this machine)."""

    backend: type[Backend]
    partitions: tuple[Partition, ...] | None

    def check_fits(self, job: LaunchJob) -> Partition | None:
        """The partition the job goes to (None on this machine); a UsageError if it cannot fit."""
        if self.partitions is None:
            check_local_resources(job.resources)
            return None
        return check_partition(job.resources, list(self.partitions))


def find_site(option: str) -> Site:
    """Ask SLURM once (only when ``option`` may send jobs there) and choose the backend."""
    may_use_slurm = any(not kind.runs_here for kind in registry.candidates_for(option))
    partitions = probe_partitions() if may_use_slurm else None
    kind = registry.choose(option, has_slurm=partitions is not None)
    return Site(kind, None if kind.runs_here else tuple(partitions or ()))


def site_for(kind: type[Backend]) -> Site:
    """The site of a backend chosen by name (the Python API's ``cluster=``)."""
    if kind.runs_here:
        return Site(kind, None)
    partitions = probe_partitions()
    if partitions is None:
        raise UsageError(
            f"the {kind.label} backend needs SLURM and no controller answers (sinfo failed); "
            "start one with `orchestrator cluster up` and export SLURM_CONF"
        )
    return Site(kind, tuple(partitions))


def check_jobs(
    site: Site,
    jobs: Sequence[LaunchJob],
    *,
    retries: int = 0,
    plan_check: bool = True,
    skip_hint: str = "--no-plan-check",
) -> None:
    """Every check of a launch at ``site``, in order: programs and resources, retries, plan
    check."""
    partitions = []
    for job in jobs:
        with prefixed(job.label):
            check_programs(job.programs)
            partitions.append(site.check_fits(job))
    check_backend_retries(retries, site.backend)
    if not plan_check or not any(job.training for job in jobs):
        return
    from orchestrator.planner.plan_check import plan_check_job

    unknown_memory: set[JobResources] = set()  # say once that the check is skipped, not per job
    for job, partition in zip(jobs, partitions, strict=True):
        if job.training is None or job.resources in unknown_memory:
            continue
        if not plan_check_job(job.training, job.resources, partition, job.name, skip_hint):
            unknown_memory.add(job.resources)


def prepare_launch(
    option: str,
    jobs: Sequence[LaunchJob],
    run_dir: Path,
    *,
    retries: int = 0,
    plan_check: bool = True,
    skip_hint: str = "--no-plan-check",
) -> Backend:
    """Probe, choose the backend and check every job; the backend to submit through."""
    site = find_site(option)
    check_jobs(site, jobs, retries=retries, plan_check=plan_check, skip_hint=skip_hint)
    return site.backend.for_run_dir(run_dir)
