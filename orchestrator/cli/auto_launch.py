"""``auto_launch``: submit a chain of a recipe's jobs, here or (``--host``) on a login node."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from contract.seeds import chain_seeds
from orchestrator import remote
from orchestrator.arrays import array_submissions, check_parallelism
from orchestrator.backends.base import Backend
from orchestrator.backends.local import LocalBackend
from orchestrator.backends.slurm import SlurmBackend
from orchestrator.chain import ChainPlan, ThenJob, submit_chain, write_scripts
from orchestrator.chain_hooks import judge_for
from orchestrator.chain_status import chain_status
from orchestrator.cli.chain_view import (
    code_line,
    index_label,
    jobs_label,
    print_table,
    status_line,
    summary,
)
from orchestrator.cli.launch_arguments import auto_launch_parser, split_script_args
from orchestrator.cli.program import run_program, say
from orchestrator.errors import EXIT_CHAIN_FAILED, UsageError
from orchestrator.launch import LaunchJob, prepare_launch, then_job
from orchestrator.launch_checks import check_run_dir
from orchestrator.manifest import FAILED_STATUSES, MANIFEST_NAME, JobRecord, orch_home
from orchestrator.scripts import PreparedScript, read_recipe
from orchestrator.seeds import validate_base_seed
from orchestrator.snapshot import CodeSource, plan_code
from orchestrator.sweep import (
    arrays_for,
    check_array_limits,
    new_sweep_id,
    print_sweep,
    queue_members,
)


def build_plan(
    args: argparse.Namespace, script_args: list[str]
) -> tuple[ChainPlan, PreparedScript]:
    """Validate the request (preflight, part one) and decide everything but the job ids."""
    recipe, prepared = read_recipe(args.recipe)
    then = ThenJob.load(args.then, "--then") if args.then else None
    return plan_chain(args, script_args, recipe, prepared, then), prepared


def plan_chain(
    args: argparse.Namespace,
    script_args: list[str],
    recipe: Path,
    prepared: PreparedScript,
    then: ThenJob | None,
    member: Member | None = None,
) -> ChainPlan:
    """The chain the options ask for; ``member``: one replica of ``--members``, with its run
    dir, base seed, ids and the code the replicas share."""
    return ChainPlan.create(
        job_name=args.name or recipe.stem,
        recipe=recipe,
        script_text=prepared.text,
        run_dir=member.run_dir if member else args.run_dir,
        num_jobs=args.num_jobs,
        dependency_kind=args.dependency,
        base_seed=member.base_seed if member else args.seed,
        script_args=tuple(script_args),
        chain_id=member.chain_id if member else None,
        sweep_id=member.sweep_id if member else None,
        then=then,
        retries=args.retries,
        retry_on_exit=args.retry_on_exit,
        max_stalled=args.max_stalled,
        restarts_in_job=args.restarts_in_job,
        exclude_slow_nodes=args.exclude_slow_nodes,
        readmit_slow_nodes=args.readmit_slow_nodes,
        code=args.code,
        code_limit_mb=args.code_limit_mb,
        code_source=member.code if member else None,
    )


@dataclass(frozen=True)
class Member:
    """One replica of ``auto_launch --members``: a chain of its own within the sweep."""

    sweep_id: str
    index: int
    run_dir: Path
    base_seed: int
    code: CodeSource

    @property
    def chain_id(self) -> str:
        return f"{self.sweep_id}-{self.index}"


def launch_members(args: argparse.Namespace) -> int:
    """``auto_launch --members M``: M chains of the recipe, each with seeds of its own, queued
    as one job array per link on SLURM (orchestrator/arrays.py) and registered as a sweep."""
    count, parallelism = args.members, args.array_parallelism
    if count < 1:
        raise UsageError(f"--members {count}: give at least 1 replica")
    check_parallelism(parallelism, "--array-parallelism")
    if args.seed is not None:
        validate_base_seed(args.seed)
    recipe, prepared = read_recipe(args.recipe)
    then = ThenJob.load(args.then, "--then") if args.then else None
    sweep_id = new_sweep_id(args.name or recipe.stem)
    base = (args.run_dir or orch_home() / "runs" / sweep_id).expanduser().resolve()
    check_run_dir(base)
    code = plan_code(args.code, Path.cwd(), base, args.code_limit_mb)
    seeds = chain_seeds(count, args.seed)
    plans = [
        plan_chain(
            args,
            args.script_args,
            recipe,
            prepared,
            then,
            Member(sweep_id, i, base / str(i), seeds[i], code),
        )
        for i in range(count)
    ]
    backend = prepare_launch(
        args.backend,
        launch_jobs(plans[0], prepared, not args.no_plan_check),
        base,
        retries=args.retries,
    )
    arrays = arrays_for(backend, args.dependency)
    if arrays:
        check_array_limits(plans, list(range(count)))
    if args.dry_run:
        print_members_dry_run(plans, backend, sweep_id, arrays, parallelism)
        return 0
    manifests = queue_members(
        [(i, plan, []) for i, plan in enumerate(plans)],
        backend,
        sweep_id,
        arrays=arrays,
        parallelism=parallelism,
    )
    if args.json:
        chains = [
            {"chain_id": m.chain_id, "run_dir": m.run_dir, "jobs": m.job_ids()} for m in manifests
        ]
        print(json.dumps({"sweep_id": sweep_id, "backend": backend.label, "chains": chains}))
    else:
        print_sweep(sweep_id, args.num_jobs, manifests)
    if backend.runs_here:
        ended = [chain_status(m, backend.statuses(m.job_ids())).status for m in manifests]
        return EXIT_CHAIN_FAILED if any(status in FAILED_STATUSES for status in ended) else 0
    return 0


def print_members_dry_run(
    plans: list[ChainPlan], backend: Backend, sweep_id: str, arrays: bool, parallelism: int | None
) -> None:
    """What ``--members`` would queue: each member's seeds, and on SLURM each array's sbatch."""
    import shlex

    first = plans[0]
    how = f"{first.total_jobs} job array(s)" if arrays else f"{len(plans)} chain(s)"
    print(f"# sweep {sweep_id}: {len(plans)} member(s) of {first.num_jobs} job(s), as {how}")
    for index, plan in enumerate(plans):
        print(f"# member {index}: run dir {plan.run_dir}, seeds {list(plan.seeds)}")
    if not arrays:
        return
    assert isinstance(backend, SlurmBackend)
    for submission in array_submissions(list(enumerate(plans)), sweep_id, parallelism):
        print(shlex.join(backend.array_command_line(submission)))


def launch_jobs(plan: ChainPlan, prepared: PreparedScript, plan_check: bool) -> list[LaunchJob]:
    """The chain's job and its --then job as the launch checks see them."""
    training = None
    if plan_check and prepared.spec is not None:
        from orchestrator.planner.plan_check import training_job

        training = training_job([*prepared.spec.command, *plan.script_args])
    programs = prepared.programs
    jobs = [LaunchJob(prepared.resources, str(plan.recipe), training=training, programs=programs)]
    if plan.then is not None:
        jobs.append(then_job(plan.then))
    return jobs


def print_dry_run(plan: ChainPlan, backend: Backend) -> None:
    import shlex

    then = " and a --then job" if plan.then else ""
    print(
        f"# chain {plan.chain_id}: {plan.num_jobs} job(s){then}, backend {backend.label}, dry run"
    )
    print(f"# run dir: {plan.run_dir}")
    if plan.code is not None:
        print(f"# {plan.code.describe()}")
    after: str | None = None
    for index in range(plan.total_jobs):
        request = plan.request(index, after)
        role = " (--then)" if plan.is_then(index) else ""
        print(f"# job {index}{role}: seed {request.seed}")
        print(shlex.join(backend.command_line(request, after)))
        after = f"<job id of job {index}>"
    for index, path, text in plan.script_copies():
        print(f"# script {path}:")
        print(text, end="" if text.endswith("\n") else "\n")
        verdict = test_only_in_scratch(plan, backend, index)
        if verdict is not None:
            print(f"# sbatch --test-only: {verdict}")


def test_only_in_scratch(plan: ChainPlan, backend: Backend, index: int) -> str | None:
    """sbatch --test-only needs the script on disk; use a scratch copy, not the run dir."""
    import dataclasses
    import tempfile

    with tempfile.TemporaryDirectory(prefix="orch-dry-run-") as scratch:
        scratch_plan = dataclasses.replace(plan, run_dir=Path(scratch))
        write_scripts(scratch_plan)
        return backend.test_only(scratch_plan.request(index, None))


def auto_launch(args: argparse.Namespace) -> int:
    if args.host and args.members is not None:
        raise UsageError(
            "--members with --host: run it on the login node itself (ssh there, then "
            "auto_launch --members), or sweep with hydra/launcher=chain_slurm there"
        )
    if args.host:
        return launch_on_host(args)
    if args.members is not None:
        return launch_members(args)
    if args.array_parallelism is not None:
        raise UsageError("--array-parallelism throttles the arrays of --members M; give both")
    plan, prepared = build_plan(args, args.script_args)
    backend = prepare_launch(
        args.backend,
        launch_jobs(plan, prepared, not args.no_plan_check),
        plan.run_dir,
        retries=plan.retries,
    )
    if args.dry_run:
        print_dry_run(plan, backend)
        return 0

    def announce(record: JobRecord) -> None:
        if not isinstance(backend, LocalBackend):  # it reports each job itself
            which = "the --then job" if record.then else f"job {record.index + 1}/{plan.num_jobs}"
            say(
                f"submitted {which}: id {record.job_id}, "
                f"seed {record.seed}, {record.dependency or 'no dependency'}"
            )

    manifest = submit_chain(plan, backend, on_submitted=announce, judge=judge_for(backend))
    statuses = backend.statuses(manifest.job_ids())
    ended = chain_status(manifest, statuses)
    # A chain that ran here has ended: its status is the launch's outcome.
    code = EXIT_CHAIN_FAILED if backend.runs_here and ended.status in FAILED_STATUSES else 0
    if args.json:
        print(json.dumps(summary(manifest, statuses, ended)))
        return code
    print(f"chain {manifest.chain_id} ({backend.label}): {jobs_label(manifest)} job(s)")
    print(f"run dir  {manifest.run_dir}")
    if plan.code is not None:
        print(plan.code.describe())
    print(f"manifest {manifest.path}")
    rows = [
        [
            index_label(job.index, job.then),
            str(job.job_id),
            str(job.seed),
            job.dependency or "-",
            statuses[job.job_id].state,
            statuses[job.job_id].start_estimate or "-",
        ]
        for job in manifest.jobs
    ]
    print_table(rows, ["index", "job_id", "seed", "dependency", "state", "start_estimate"])
    if backend.runs_here:
        print(status_line(ended))
    return code


def launch_on_host(args: argparse.Namespace) -> int:
    """``auto_launch --host``: the same launch on a login node (orchestrator/remote.py), its
    summary printed as a local launch prints it."""
    forwarded = remote.forwarded_argv(auto_launch_parser(), args.own_args)
    done = remote.launch(args, forwarded, args.script_args)
    if done.summary is None:
        return done.exit_code
    summary, host = done.summary, done.summary["host"]
    if args.json:
        print(json.dumps(summary))
        return 0
    jobs = summary["jobs"]
    then = "+then" if any(job["then"] for job in jobs) else ""
    print(f"chain {summary['chain_id']} ({summary['backend']} on {host}): "
          f"{len(jobs) - bool(then)}{then} job(s)")  # fmt: skip
    print(f"run dir  {host}:{summary['run_dir']}")
    print(code_line(summary["code"]))
    mirror = f" (copy: {done.mirror})" if done.mirror else ""
    print(f"manifest {host}:{summary['run_dir']}/{MANIFEST_NAME}{mirror}")
    rows = [
        [
            index_label(job["index"], job["then"]),
            str(job["job_id"]),
            str(job["seed"]),
            job["dependency"] or "-",
            job["state"] or "?",
        ]
        for job in jobs
    ]
    print_table(rows, ["index", "job_id", "seed", "dependency", "state"])
    return 0


def auto_launch_main(argv: list[str] | None = None) -> int:
    own_args, script_args = split_script_args(list(sys.argv[1:] if argv is None else argv))
    args = auto_launch_parser().parse_args(own_args)
    args.script_args = script_args
    args.own_args = own_args
    return run_program(auto_launch, args)
