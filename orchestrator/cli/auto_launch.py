"""``auto_launch``: submit a chain of a recipe's jobs, here or (``--host``) on a login node."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from orchestrator import remote
from orchestrator.backends.base import Backend
from orchestrator.backends.local import LocalBackend
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
from orchestrator.errors import EXIT_CHAIN_FAILED
from orchestrator.launch import LaunchJob, prepare_launch, then_job
from orchestrator.manifest import FAILED_STATUSES, MANIFEST_NAME, JobRecord
from orchestrator.scripts import PreparedScript, read_recipe


def build_plan(
    args: argparse.Namespace, script_args: list[str]
) -> tuple[ChainPlan, PreparedScript]:
    """Validate the request (preflight, part one) and decide everything but the job ids."""
    recipe, prepared = read_recipe(args.recipe)
    then = ThenJob.load(args.then, "--then") if args.then else None
    plan = ChainPlan.create(
        job_name=args.name or recipe.stem,
        recipe=recipe,
        script_text=prepared.text,
        run_dir=args.run_dir,
        num_jobs=args.num_jobs,
        dependency_kind=args.dependency,
        base_seed=args.seed,
        script_args=tuple(script_args),
        then=then,
        retries=args.retries,
        retry_on_exit=args.retry_on_exit,
        max_stalled=args.max_stalled,
        restarts_in_job=args.restarts_in_job,
        code=args.code,
        code_limit_mb=args.code_limit_mb,
    )
    return plan, prepared


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
    if args.host:
        return launch_on_host(args)
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
