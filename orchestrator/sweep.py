"""A chained sweep: each member of a Hydra multirun becomes a chain of N jobs, as auto_launch does.

Each member's recipe is the sweep's resources plus one command, the member's ``python -m train``
with its overrides, ``seed=${SEED}`` and ``run_dir=${ORCH_RUN_DIR}``, so every job of the chain
resumes the member's training; with a --then recipe (``hydra.launcher.then``) each member's chain
ends with that job, in the member's run dir, given its seed alone. Every member is planned,
rendered and preflighted before the first submission; if a submission fails, what was queued
is cancelled. On SLURM each link of all members is one job array (orchestrator/arrays.py), the
cluster's array limits read before anything is queued. The sweep index (``register_sweep``)
lets ``orchestrator status|cancel|logs SWEEP`` see all members at once.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from orchestrator.arrays import check_limits, submit_arrays
from orchestrator.backends.base import Backend
from orchestrator.backends.slurm import SlurmBackend
from orchestrator.chain import ChainPlan, ThenJob, new_chain_id, rollback, submit_chain
from orchestrator.chain_hooks import judge_for
from orchestrator.errors import SchedulerError, UsageError
from orchestrator.launch import LaunchJob, prepare_launch, then_job
from orchestrator.manifest import Manifest, register_sweep
from orchestrator.recipe import load_recipe, parse_recipe
from orchestrator.render import render_recipe
from orchestrator.slurm.commands import array_limits
from orchestrator.slurm.resources import JobResources
from orchestrator.snapshot import DEFAULT_LIMIT_MB, SNAPSHOT, CodeSource, plan_code

BACKENDS = ("slurm", "local")
# libyaml's safe dumper where PyYAML has it: a sweep writes one recipe per member.
RECIPE_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


@dataclass(frozen=True)
class SweepMember:
    """One point of the sweep: Hydra's job number, its overrides and where it trains."""

    index: int
    overrides: tuple[str, ...]
    run_dir: Path
    base_seed: int | None  # derive the chain's job seeds from it; None: fresh random seeds
    config: Any = None  # the trainer config its jobs run, for the plan check (None: no check)

    @property
    def label(self) -> str:
        return f"sweep member #{self.index} ({' '.join(self.overrides) or 'no overrides'})"


@dataclass(frozen=True)
class SweepRequest:
    """What every member shares: the trainer's argv, the resources, the chain settings."""

    sweep_id: str
    job_name: str
    train_argv: tuple[str, ...]  # e.g. (python, -m, train, --config-name, tiny_fsdp2)
    resources: dict[str, Any]  # the recipe settings given (every field but command)
    num_jobs: int
    dependency: str
    backend: str  # slurm | local
    workdir: Path
    then: ThenJob | None = None  # each member's chain ends with it
    retries: int = 0  # replacements each member's chain may queue (auto_launch --retries)
    code: str = SNAPSHOT  # what each member's jobs run (auto_launch --code)
    # On SLURM, each link of every member as one job array (orchestrator/arrays.py), at most
    # ``array_parallelism`` of its tasks running at once (None: as many as the cluster runs).
    arrays: bool = True
    array_parallelism: int | None = None


@dataclass(frozen=True)
class PlannedMember:
    member: SweepMember
    plan: ChainPlan
    recipe_fields: dict[str, Any]
    job: LaunchJob


def new_sweep_id(stem: str) -> str:
    return new_chain_id(f"{stem}-sweep")


def recipe_resources(path: Path) -> dict[str, Any]:
    """The settings a YAML recipe sets (validated whole); its command gets replaced."""
    return load_recipe(path).model_dump(exclude_unset=True, exclude={"command"})


def member_command(request: SweepRequest, member: SweepMember) -> list[str]:
    return [*request.train_argv, *member.overrides, "seed=${SEED}", "run_dir=${ORCH_RUN_DIR}"]


def plan_member(
    request: SweepRequest, member: SweepMember, code: CodeSource | None = None
) -> PlannedMember:
    """Render and check one member's chain; nothing is written or submitted."""
    fields = {**request.resources, "command": member_command(request, member)}
    recipe_path = member.run_dir / f"{request.job_name}.yaml"
    try:
        spec = parse_recipe(fields, recipe_path)
    except UsageError as error:
        raise UsageError(f"{member.label}: {error}") from error
    text = render_recipe(spec)
    plan = ChainPlan.create(
        job_name=request.job_name,
        recipe=recipe_path,
        script_text=text,
        run_dir=member.run_dir,
        num_jobs=request.num_jobs,
        dependency_kind=request.dependency,
        base_seed=member.base_seed,
        chain_id=f"{request.sweep_id}-{member.index}",
        sweep_id=request.sweep_id,
        workdir=request.workdir,
        then=request.then,
        retries=request.retries,
        code=request.code,
        code_source=code,
    )
    config = member.config
    job = LaunchJob(
        JobResources.from_settings(spec),
        member.label,
        training=None if config is None else lambda: config,
        programs=spec.programs(),
    )
    return PlannedMember(member, plan, fields, job)


def preflight_sweep(
    request: SweepRequest, members: list[SweepMember]
) -> tuple[list[PlannedMember], Backend]:
    """Every check auto_launch makes, for every member, before anything is submitted."""
    if request.backend not in BACKENDS:
        raise UsageError(f"backend {request.backend!r}: choose one of {', '.join(BACKENDS)}")
    if not members:
        raise UsageError("the sweep has no members")
    code = plan_code(request.code, request.workdir, members[0].run_dir.parent, DEFAULT_LIMIT_MB)
    planned = [plan_member(request, member, code) for member in members]
    jobs = [item.job for item in planned]
    if request.then is not None:
        jobs.append(then_job(request.then))
    backend = prepare_launch(
        request.backend,
        jobs,
        planned[0].plan.run_dir,
        retries=request.retries,
        skip_hint="hydra.launcher.plan_check=false",
    )
    if queues_arrays(request, backend):
        check_array_limits([item.plan for item in planned], [m.index for m in members])
    return planned, backend


def queues_arrays(request: SweepRequest, backend: Backend) -> bool:
    return arrays_for(backend, request.dependency) and request.arrays


def arrays_for(backend: Backend, dependency: str) -> bool:
    """Whether members' chains go to SLURM as job arrays: on the slurm backend, where each
    job waits on the one before (a ``singleton`` job waits on every job of its name, which
    would be every member's)."""
    return isinstance(backend, SlurmBackend) and dependency != "singleton"


def check_array_limits(plans: list[ChainPlan], indexes: list[int]) -> None:
    """The cluster's MaxArraySize and MaxJobCount, read before anything is queued."""
    try:
        limits = array_limits()
    except SchedulerError as error:
        raise UsageError(f"cannot read the cluster's limits for job arrays: {error}") from None
    check_limits(len(plans), max(indexes), len(plans) * plans[0].total_jobs, limits)


def submit_sweep(request: SweepRequest, members: list[SweepMember]) -> list[Manifest]:
    """Preflight all members, write their recipes, queue their chains, register the sweep.

    Returns as soon as the jobs are queued (the local backend runs them before returning, as it
    does for auto_launch). A failed submission cancels what was queued for the sweep.
    """
    planned, backend = preflight_sweep(request, members)
    for item in planned:
        item.plan.run_dir.mkdir(parents=True, exist_ok=True)
        recipe_text = yaml.dump(item.recipe_fields, Dumper=RECIPE_DUMPER, sort_keys=False)
        item.plan.recipe.write_text(recipe_text)
    return queue_members(
        [(item.member.index, item.plan, list(item.member.overrides)) for item in planned],
        backend,
        request.sweep_id,
        arrays=queues_arrays(request, backend),
        parallelism=request.array_parallelism,
    )


def queue_members(
    members: list[tuple[int, ChainPlan, list[str]]],
    backend: Backend,
    sweep_id: str,
    *,
    arrays: bool,
    parallelism: int | None = None,
) -> list[Manifest]:
    """Queue every member's chain (index, plan, the overrides that name it), then register the
    sweep: as job arrays (``arrays``; at most ``parallelism`` tasks of each at once), else one
    chain after another. What was queued before a failed submission is cancelled."""
    manifests: list[Manifest] = []
    if arrays:
        assert isinstance(backend, SlurmBackend)
        plans = [(index, plan) for index, plan, _ in members]
        manifests = submit_arrays(plans, backend, sweep_id, parallelism)
        register_sweep(sweep_id, sweep_entries(manifests, members))
        return manifests
    try:
        for _, plan, _ in members:
            manifests.append(submit_chain(plan, backend, judge=judge_for(backend)))
    except (SchedulerError, KeyboardInterrupt) as error:
        for manifest in manifests:
            rollback(manifest, backend, error)
        raise
    finally:
        if manifests:
            register_sweep(sweep_id, sweep_entries(manifests, members))
    return manifests


def sweep_entries(
    manifests: list[Manifest], members: list[tuple[int, ChainPlan, list[str]]]
) -> list[dict]:
    """The sweep index's members: chain id, run dir and overrides of each submitted one."""
    return [
        {"chain_id": manifest.chain_id, "run_dir": manifest.run_dir, "overrides": overrides}
        for manifest, (_, _, overrides) in zip(manifests, members, strict=False)
    ]


def print_sweep(sweep_id: str, num_jobs: int, manifests: list[Manifest]) -> None:
    """The sweep id first (for status/cancel/logs), then one line per member chain."""
    print(f"sweep {sweep_id}: {len(manifests)} member chain(s) of {num_jobs} job(s)")
    for manifest in manifests:
        ids = ",".join(manifest.job_ids())
        print(f"  {manifest.chain_id}  jobs {ids}  run dir {manifest.run_dir}")
    print(f"follow with: orchestrator status {sweep_id}", file=sys.stderr)
