"""Command lines: ``auto_launch`` (submit a chain) and ``orchestrator`` (look after chains)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from contract.job_end import read_job_end
from contract.slurm_states import REQUEUE_GRACE_S, has_ended
from orchestrator import __version__, remote
from orchestrator.backends import registry
from orchestrator.backends.base import DEPENDENCY_KINDS, Backend, JobStatus
from orchestrator.backends.local import LocalBackend
from orchestrator.chain import ChainPlan, ThenJob, last_first, submit_chain, write_scripts
from orchestrator.chain_hooks import judge_for
from orchestrator.chain_status import ChainStatus, chain_status, trainer_error
from orchestrator.errors import (
    EXIT_CHAIN_FAILED,
    EXIT_CLOSED_PIPE,
    EXIT_INTERRUPTED,
    SchedulerError,
    UsageError,
)
from orchestrator.launch import LaunchJob, prepare_launch, then_job
from orchestrator.manifest import (
    CANCELLED,
    DEFAULT_MAX_STALLED,
    DEFAULT_RESTARTS_IN_JOB,
    FAILED_STATUSES,
    MANIFEST_NAME,
    SUBMITTED,
    JobRecord,
    Manifest,
    chain_lock,
    find_manifests,
    list_chains,
    list_sweeps,
    orch_home,
    sweep_labels,
)
from orchestrator.results import RunResults, as_json, disk_problem, format_wer, last_progress
from orchestrator.scripts import PreparedScript, read_recipe
from orchestrator.snapshot import DEFAULT_LIMIT_MB, SNAPSHOT


def _run(handler, args: argparse.Namespace) -> int:
    try:
        code = _reported(handler, args)
        sys.stdout.flush()  # inside the try: a closed pipe shows here, not at exit
        return code
    except BrokenPipeError:
        # The reader went away (``| head``; with ``2>&1 | head`` also before an error line):
        # end quietly, as shell tools do on SIGPIPE, with stdout and stderr pointed at
        # /dev/null so that the interpreter's last flush cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.dup2(devnull, sys.stderr.fileno())
        return EXIT_CLOSED_PIPE


def _reported(handler, args: argparse.Namespace) -> int:
    """The handler's exit code; bad input, a failing scheduler and Ctrl-C said on stderr."""
    try:
        return handler(args)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return UsageError.exit_code
    except SchedulerError as error:
        print(f"error: {error}", file=sys.stderr)
        return SchedulerError.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# auto_launch ---------------------------------------------------------------------------------


def auto_launch_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="auto_launch",
        description="Submit a chain of N jobs of a recipe; each job depends on the one before, "
        "gets its own seed as $1 and resumes the training the previous job left.",
        epilog="Arguments after -- are passed to the recipe after the seed.",
    )
    parser.add_argument(
        "recipe",
        help="a .sub batch script or a .yaml recipe description; a bare name that is not a file "
        "here (smoke.yaml) is a recipe shipped with the toolkit",
    )
    parser.add_argument("-n", "--num-jobs", type=int, default=1, help="jobs in the chain")
    parser.add_argument(
        "--dependency",
        default="afterany",
        choices=DEPENDENCY_KINDS,
        help="afterany (default): go on after any end; afterok: stop on a failure; singleton",
    )
    parser.add_argument("--seed", type=int, help="derive every job's seed from this one")
    parser.add_argument("--run-dir", type=Path, help="shared by the chain's jobs")
    parser.add_argument("--name", help="job name (default: the recipe's file name)")
    parser.add_argument(
        "--backend",
        default="auto",
        choices=registry.OPTIONS,
        help="auto (default): slurm when a controller answers, else local",
    )
    parser.add_argument(
        "--then",
        metavar="RECIPE",
        help="queue one more job of this recipe after the chain's last (afterany), in the same "
        "run dir with the next job index and seed: e.g. an evaluation",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=0,
        metavar="K",
        help="queue a replacement job (new seed) at the end of the chain for each job that "
        "fails in a way a new job can fix (node failure, preemption, a hang, a rank killed, "
        "the time limit before a save, a code of --retry-on-exit), up to K in all (slurm or "
        "local backend, where it runs at once; the recipe must run the chain hook, as rendered "
        "YAML recipes do)",
    )
    parser.add_argument(
        "--retry-on-exit",
        default="",
        metavar="CODES",
        help="exit codes (comma-separated) that also earn a replacement under --retries, e.g. "
        "1 for a command of your own whose failures are transient",
    )
    parser.add_argument(
        "--max-stalled",
        type=int,
        default=DEFAULT_MAX_STALLED,
        metavar="N",
        help="stop the chain (status stalled, its queued jobs cancelled) after N jobs in a row "
        "end without a newer complete checkpoint; 0: never (default %(default)s)",
    )
    parser.add_argument(
        "--restarts-in-job",
        type=int,
        default=DEFAULT_RESTARTS_IN_JOB,
        metavar="K",
        help="launch the training again inside the same job, from the newest checkpoint, when "
        "it fails in a way a new process fixes (a hang, a lost peer, a rank killed, a code of "
        "--retry-on-exit) and the job has a checkpoint interval's time left, up to K times; "
        "the same failure twice, or a job the cluster ended, goes to --retries (slurm backend, "
        "YAML recipes; default %(default)s)",
    )
    parser.add_argument(
        "--code",
        default=SNAPSHOT,
        metavar="snapshot|live|DIR",
        help="what the jobs run: snapshot (default) freezes the git work tree holding the "
        "current directory (tracked files with their uncommitted changes, untracked files git "
        "does not ignore) into RUN_DIR/code, and every job runs that copy; live: the tree as it "
        "is when each job starts; DIR: that directory. The jobs get it as ORCH_CODE_DIR",
    )
    parser.add_argument(
        "--code-limit-mb",
        type=float,
        default=DEFAULT_LIMIT_MB,
        metavar="MB",
        help="refuse a snapshot larger than this (default %(default)g)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print, submit nothing")
    parser.add_argument("--json", action="store_true", help="end with a JSON summary line")
    parser.add_argument(
        "--no-plan-check",
        action="store_true",
        help="queue a training recipe even when the planner says its layout cannot fit",
    )
    remote.add_host_options(parser, launch=True)
    return parser


def split_script_args(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return argv, []


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
        from orchestrator.planner.preflight import training_job

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


def summary(manifest: Manifest, statuses: dict[str, JobStatus], found: ChainStatus) -> dict:
    """A chain as ``--json`` prints it; ``found``: its status (``chain_status``)."""
    return {
        "chain_id": manifest.chain_id,
        "run_dir": manifest.run_dir,
        "backend": manifest.backend,
        "status": found.status,
        "code": {
            "mode": manifest.code_mode,
            "dir": manifest.code_dir,
            "commit": manifest.git_sha,
            "dirty": manifest.git_dirty,
            "diff": manifest.code_diff,
        },
        "jobs": [
            {
                "index": job.index,
                "job_id": job.job_id,
                "seed": job.seed,
                "dependency": job.dependency,
                "state": statuses[job.job_id].state if job.job_id in statuses else None,
                "then": job.then,
            }
            for job in manifest.jobs
        ],
    }


def print_table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(str(row[col])) for row in [header, *rows]) for col in range(len(header))]
    for row in [header, *rows]:
        print(
            "  ".join(
                str(cell).ljust(width) for cell, width in zip(row, widths, strict=False)
            ).rstrip()
        )


def index_label(index: int, then: bool) -> str:
    """A job's index as the tables show it: a ``--then`` job is marked."""
    return f"{index} (then)" if then else str(index)


def jobs_label(manifest: Manifest) -> str:
    """The chain's length, ``3+then`` for a chain that ends with a --then job."""
    return f"{manifest.num_jobs}+then" if manifest.then else str(manifest.num_jobs)


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


def status_line(found: ChainStatus) -> str:
    """``failed: job 1 (id 7), the last, ...``: a chain's status and, once ended, how."""
    return f"{found.status}: {found.why}" if found.why else found.status


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
    return _run(auto_launch, args)


# orchestrator --------------------------------------------------------------------------------


def backend_for(manifest: Manifest) -> Backend:
    """The backend that ran a chain, to ask it about the chain's jobs."""
    return registry.for_run_dir(manifest.backend, manifest.run_dir)


def cmd_list(args: argparse.Namespace) -> int:
    rows = []
    for entry in list_chains():
        path = Path(entry["run_dir"]) / MANIFEST_NAME
        if not path.is_file():
            rows.append([entry["chain_id"], "?", "?", "manifest missing", entry["run_dir"]])
            continue
        manifest = Manifest.load(path)
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(manifest.created))
        # a chain launched with --host: a local copy of its manifest, the run dir on the host
        where = f"{entry['host']}:" if entry.get("host") else ""
        status = manifest.status
        if status == SUBMITTED and not where:  # running, queued, or ended unjudged: ask
            statuses = backend_for(manifest).statuses(manifest.job_ids())
            status = chain_status(manifest, statuses).status
        rows.append(
            [
                manifest.chain_id,
                manifest.backend,
                jobs_label(manifest),
                status,
                created,
                where + manifest.run_dir,
            ]
        )
    if not rows:
        print(f"no chains under {orch_home()}")
        return 0
    print_table(rows, ["chain", "backend", "jobs", "status", "created", "run_dir"])
    sweeps = list_sweeps()
    if sweeps:
        print()
        print_table(
            [[entry["sweep_id"], str(len(entry["members"]))] for entry in sweeps],
            ["sweep", "members"],
        )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    manifests = find_manifests(args.chain)
    results = {manifest.chain_id: RunResults.of(manifest.run_dir) for manifest in manifests}
    labels = sweep_labels(args.chain)
    payloads = []
    for manifest in manifests:
        backend = backend_for(manifest)
        statuses = backend.statuses(manifest.job_ids())
        found = results[manifest.chain_id]
        unreachable = (backend.unreachable, backend.accounting_unreachable)
        if args.json:
            payloads.append(status_payload(manifest, statuses, found, *unreachable))
        else:
            print_status(status_payload(manifest, statuses, found, *unreachable), found)
    if labels is None:
        if args.json:
            print(json.dumps(payloads[0]))
        return 0
    ranked = sorted(manifests, key=lambda manifest: results[manifest.chain_id].rank_key())
    if args.json:
        best_first = [manifest.chain_id for manifest in ranked]
        print(json.dumps({"sweep_id": args.chain, "chains": payloads, "best_first": best_first}))
    else:
        print_ranking(args.chain, ranked, results, labels)
    return 0


def status_payload(
    manifest: Manifest,
    statuses: dict[str, JobStatus],
    results: RunResults,
    unreachable: str | None = None,
    accounting_unreachable: str | None = None,
) -> dict:
    """What ``status`` says about a chain: ``--json`` prints it, the table is drawn from it."""
    found = chain_status(manifest, statuses)
    payload = summary(manifest, statuses, found)
    payload["error"] = manifest.error
    payload["ended"] = found.why
    payload["controller_unreachable"] = unreachable
    payload["accounting_unreachable"] = accounting_unreachable
    progress = last_progress(manifest)
    for row, job in zip(payload["jobs"], manifest.jobs, strict=True):
        status = statuses.get(row["job_id"])
        record = read_job_end(manifest.run_dir, str(job.index), str(job.job_id))
        row["nodes"] = status.nodes if status else ""
        row["error"] = record.get("error") if record else None
        row["reason"] = job_reason(job, status, row["error"])
        # the training's own status: the batch shell's may be its end signal's (143)
        row["exit_code"] = record["exit_code"] if record else status.exit_code if status else None
        row["elapsed"] = status.elapsed if status else ""
        row["source"] = status.source if status else ""
        row["last_step"], row["last_loss"] = progress.get(job.index, (None, None))
    payload["disk_problem"] = disk_problem(Path(manifest.run_dir))
    payload["validation"] = as_json(results.validation)
    payload["evaluation"] = as_json(results.evaluation)
    return payload


def format_loss(loss: float | None) -> str:
    return "-" if loss is None else f"{loss:.4f}"


def unreachable_notice(unreachable: str) -> str:
    return (
        f"SLURM controller unreachable ({unreachable}): states below come from accounting "
        "(sacct) where it answers, else from the manifest and the run dir (logs, metrics)"
    )


def accounting_notice(unreachable: str) -> str:
    return (
        f"accounting (slurmdbd) unreachable ({unreachable}): jobs that left the queue are read "
        "from scontrol while it remembers them, else from the manifest and the run dir"
    )


def job_reason(job: JobRecord, status: JobStatus | None, error: str | None = None) -> str:
    """The scheduler's reason, after what the chain's judgement made of the job (its outcome,
    the trainer's ``error:`` line, and for a replacement the job it replaces)."""
    parts = []
    if job.outcome:
        parts.append(job.outcome)
    if error:
        parts.append(f"error: {error}")
    if job.replaces is not None:
        parts.append(f"replaces job {job.replaces}" + (f" ({job.reason})" if job.reason else ""))
    if job.restarts:
        parts.append(f"preempted and requeued {job.restarts}x")
    if job.in_job_restarts:
        parts.append(f"restarted in place {job.in_job_restarts}x")
    if status and status.reason:
        parts.append(status.reason)
    return "; ".join(parts)


def code_line(code: dict) -> str:
    """What the chain's jobs run, in one line: the commit, dirty or not, and from where."""
    commit = (code["commit"] or "no commit")[:12] + (" (dirty)" if code["dirty"] else "")
    where = {"snapshot": f"snapshot {code['dir']}", "dir": f"from {code['dir']}"}
    return f"code: {commit}, {where.get(code['mode'] or '', 'live tree')}"


def print_status(payload: dict, results: RunResults) -> None:
    """The chain's status as a table: ``status_payload``'s, so the two never disagree."""
    chain, backend, run_dir = payload["chain_id"], payload["backend"], payload["run_dir"]
    print(
        f"chain {chain} ({backend}, {payload['status']})  {run_dir}  {code_line(payload['code'])}"
    )
    if payload["controller_unreachable"]:
        print(unreachable_notice(payload["controller_unreachable"]))
    if payload["accounting_unreachable"]:
        print(accounting_notice(payload["accounting_unreachable"]))
    if payload["disk_problem"]:
        print(f"warning: {payload['disk_problem']}")
    if payload["error"]:
        print(f"error: {payload['error']}")
    if payload["ended"] and payload["status"] != "complete":
        print(f"{payload['status']}: {payload['ended']}")
    print(f"latest: {results.describe()}")
    per_set = results.per_set()
    if per_set:
        print_table(
            [
                [name, format_loss(val_loss), format_wer(wer) if wer is not None else "-"]
                for name, (val_loss, wer) in per_set.items()
            ],
            ["set", "val_loss", "wer"],
        )
    rows = [
        [
            index_label(job["index"], job["then"]),
            str(job["job_id"]),
            str(job["seed"]),
            job["state"] or "?",
            "-" if job["last_step"] is None else str(job["last_step"]),
            format_loss(job["last_loss"]),
            "-" if job["exit_code"] is None else str(job["exit_code"]),
            job["elapsed"] or "-",
            job["nodes"],
            job["reason"],
        ]
        for job in payload["jobs"]
    ]
    header = ["index", "job_id", "seed", "state", "step", "loss", "exit", "elapsed", "nodes"]
    print_table(rows, [*header, "reason"])


def print_ranking(
    sweep_id: str,
    ranked: list[Manifest],
    results: dict[str, RunResults],
    labels: dict[str, str],
) -> None:
    """The sweep's members best first (by WER, else val_loss), each with what set it apart."""
    print(f"sweep {sweep_id}: {len(ranked)} member(s), best first")
    rows = []
    for rank, manifest in enumerate(ranked, start=1):
        found = results[manifest.chain_id]
        evaluation, validation = found.evaluation, found.validation
        label = labels.get(manifest.chain_id, manifest.chain_id)
        rows.append(
            [
                str(rank),
                manifest.chain_id,
                format_wer(evaluation.wer) if evaluation else "-",
                str(evaluation.step) if evaluation else "-",
                format_loss(validation.val_loss if validation else None),
                str(validation.step) if validation else "-",
                "" if label == manifest.chain_id else label,
            ]
        )
    header = ["rank", "chain", "wer", "eval_step", "val_loss", "val_step", "overrides"]
    print_table(rows, header)


def cmd_cancel(args: argparse.Namespace) -> int:
    for manifest in find_manifests(args.chain):
        backend = backend_for(manifest)
        statuses = backend.statuses(manifest.job_ids())
        live = [job_id for job_id, status in statuses.items() if not has_ended(status.state)]
        backend.cancel(last_first(live))
        with chain_lock(Path(manifest.run_dir)):  # the hooks judge no more jobs of it
            current = Manifest.load(manifest.path)
            if current.status == SUBMITTED:
                current.status, current.ended = CANCELLED, f"cancelled by hand ({len(live)} job(s))"
                current.save()
        print(f"chain {manifest.chain_id}: cancelled {len(live)} job(s) {' '.join(live)}".rstrip())
    return 0


def log_path(manifest: Manifest, job: JobRecord) -> Path | None:
    """The job's log, where the chain's backend keeps it."""
    pattern = registry.by_label(manifest.backend).log_glob(str(job.job_id))
    matches = sorted(Path(manifest.run_dir).glob(pattern))
    return matches[0] if matches else None


def cmd_logs(args: argparse.Namespace) -> int:
    for manifest in find_manifests(args.chain):
        jobs = manifest.jobs
        if args.job is not None:
            if not 0 <= args.job < len(jobs):
                raise UsageError(
                    f"--job {args.job}: chain {manifest.chain_id} has jobs 0..{len(jobs) - 1}"
                )
            jobs = [jobs[args.job]]
        backend = backend_for(manifest)
        for job in jobs:
            print(
                f"==> {manifest.chain_id} job {job.index} (id {job.job_id}, seed {job.seed}) <==",
                flush=True,
            )
            if args.follow:
                follow(manifest, job, backend)
                continue
            path = log_path(manifest, job)
            if path is None:
                print("(no log yet)")
            else:
                sys.stdout.write(path.read_text(errors="replace"))
            said = trainer_error(manifest.run_dir, job)
            if said:
                print(f"==> job {job.index} ended on the training's error: {said} <==")
    return 0


def follow(
    manifest: Manifest,
    job: JobRecord,
    backend: Backend,
    poll_s: float = 0.5,
    requeue_grace_s: float = REQUEUE_GRACE_S,
) -> None:
    """Stream a job's log until the job has ended and the log has no more to give. A job seen
    PREEMPTED is followed on for ``requeue_grace_s``: requeued, it is PENDING again and runs on
    under the same id."""
    offset = 0
    preempted_since = None
    while True:
        state = backend.statuses([job.job_id])[job.job_id].state
        preempted = state == "PREEMPTED"
        preempted_since = (preempted_since or time.monotonic()) if preempted else None
        path = log_path(manifest, job)
        if path is not None:
            with open(path, errors="replace") as handle:
                handle.seek(offset)
                chunk = handle.read()
                offset = handle.tell()
            if chunk:
                sys.stdout.write(chunk)
                sys.stdout.flush()
                continue
        if backend.unreachable:
            say(f"stopped following: SLURM controller unreachable ({backend.unreachable})")
            return
        requeue_possible = preempted and time.monotonic() - preempted_since < requeue_grace_s
        if (has_ended(state) and not requeue_possible) or state == "UNKNOWN":
            return
        time.sleep(poll_s)


def cmd_plot(args: argparse.Namespace) -> int:
    from orchestrator.plot import default_output, draw, plot_data

    data = plot_data(args.chain)
    out = draw(data, args.output or default_output(args.chain))
    for chain_id in data.without_metrics:
        say(f"chain {chain_id}: no metrics yet, left out")
    print(out)
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    from orchestrator.dashboard import load_spec, save_workspace

    spec = load_spec(args.spec)
    print(save_workspace(spec, entity=args.entity, project=args.project, name=args.name))
    return 0


def on_host(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``status``, ``logs`` and ``cancel`` of a chain on a login node (``--host``, or the host
    a chain launched with ``auto_launch --host`` lives on) run there over ssh."""

    def run(args: argparse.Namespace) -> int:
        where = remote.remote_for(args)
        if where is None:
            return handler(args)
        forwarded = remote.forwarded_argv(orchestrator_parser(), args.argv)
        return remote.run_command(where, args, forwarded)

    return run


def orchestrator_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orchestrator", description="Look after chains of jobs.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="chains launched from this machine")
    listing.set_defaults(handler=cmd_list)
    status = commands.add_parser("status", help="per job: id, seed, state, nodes")
    status.add_argument("chain", help="chain id, sweep id or run dir")
    status.add_argument("--json", action="store_true")
    status.set_defaults(handler=on_host(cmd_status))
    cancel = commands.add_parser("cancel", help="cancel a chain's unfinished jobs")
    cancel.add_argument("chain")
    cancel.set_defaults(handler=on_host(cmd_cancel))
    logs = commands.add_parser("logs", help="print (or --follow) a chain's job logs")
    logs.add_argument("chain")
    logs.add_argument("--job", type=int, help="only job K (0-based)")
    logs.add_argument("--follow", action="store_true", help="stream until the jobs finish")
    logs.set_defaults(handler=on_host(cmd_logs))
    for command in (status, cancel, logs):
        remote.add_host_options(command)
    plot = commands.add_parser("plot", help="loss and tokens/s against step, as a PNG")
    plot.add_argument("chain", help="chain id, sweep id or run dir")
    plot.add_argument(
        "-o",
        "--output",
        type=Path,
        help="PNG to write (default: RUN_DIR/plot.png for a chain, "
        "$ORCH_HOME/sweeps/<id>.png for a sweep)",
    )
    plot.set_defaults(handler=cmd_plot)
    dashboard = commands.add_parser(
        "dashboard", help="create the W&B workspace of the shipped dashboard spec (online)"
    )
    dashboard.add_argument("--entity", required=True, help="W&B user or team")
    dashboard.add_argument("--project", required=True, help="W&B project (the trainer's: speechlm)")
    dashboard.add_argument("--name", help="workspace name (default: the spec's)")
    dashboard.add_argument("--spec", type=Path, help="dashboard spec (default: the shipped one)")
    dashboard.set_defaults(handler=cmd_dashboard)
    from orchestrator.planner.cli import add_plan_parser, cmd_plan

    add_plan_parser(commands)
    commands.choices["plan"].set_defaults(handler=cmd_plan)
    from orchestrator import cluster

    cluster.add_cluster_parser(commands)
    return parser


def orchestrator_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = orchestrator_parser().parse_args(argv)
    args.argv = argv
    return _run(args.handler, args)


if __name__ == "__main__":
    sys.exit(orchestrator_main())
