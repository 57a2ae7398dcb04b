"""Thin subprocess shell around SLURM's command-line tools.

Every call has a timeout, and calls that fail with a transient controller error (the controller
busy or restarting) are retried through orchestrator.retry before the failure reaches the user.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Sequence

from orchestrator.errors import SchedulerError, SchedulerTimeout
from orchestrator.retry import TRANSIENT_MARKERS, with_retries
from orchestrator.slurm.partitions import PARTITION_FORMAT, Partition, parse_partitions

# Queries behind `orchestrator status`: it must answer within seconds even when the controller is
# gone (squeue alone spends MessageTimeout retrying a dead one), so each query gets this long,
# and one more try only after `scontrol ping` said the controller is up.
QUERY_TIMEOUT_S = 5.0
QUERY_ATTEMPTS = 2
# What squeue and scontrol say of a job id the controller does not know (never given, or purged
# after MinJobAge).
INVALID_JOB_ID = "Invalid job id specified"


def update_dependency(job_id: str, spec: str) -> None:
    """Make queued job ``job_id`` wait on ``spec`` (SLURM's dependency syntax) instead."""
    run_slurm(["scontrol", "update", f"JobId={job_id}", f"Dependency={spec}"])


def update_excluded(job_id: str, nodes: str) -> None:
    """Keep queued job ``job_id`` off ``nodes`` (a SLURM hostlist; empty: off none)."""
    run_slurm(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={nodes}"])


def node_states(partitions: str) -> dict[str, str]:
    """Each node of ``partitions`` (comma-separated) and its state, as sinfo's ``%t`` says."""
    output = run_slurm(
        ["sinfo", "--noheader", "--Node", f"--partition={partitions}", "--format=%N %t"],
        timeout_s=QUERY_TIMEOUT_S,
    )
    return dict(line.split() for line in output.splitlines() if len(line.split()) == 2)


def cancel_jobs(job_ids: list[str]) -> None:
    """``scancel`` the jobs, in the order given (a chain's: last first)."""
    if job_ids:
        run_slurm(["scancel", *job_ids])


def requeue_job(job_id: str) -> None:
    """Put a running job back in the queue with the same id (SLURM ends its current run)."""
    run_slurm(["scontrol", "requeue", job_id])


def query_jobs(argv: list[str]) -> str:
    """The output of a query about given jobs (squeue, scontrol); empty when the controller
    knows none of them: it refuses a lone id it has forgotten (purged after MinJobAge) where
    it drops unknown ones from a longer list."""
    try:
        return run_slurm(argv, timeout_s=QUERY_TIMEOUT_S, attempts=QUERY_ATTEMPTS)
    except SchedulerError as error:
        if INVALID_JOB_ID in str(error):
            return ""
        raise


def job_fields(line: str) -> dict[str, str]:
    """One job's line of ``scontrol show job -o`` as a dict (empty for any other line)."""
    fields: dict[str, str] = {}
    for word in line.split():
        name, sep, value = word.partition("=")
        if sep:
            fields[name] = value
    return fields


def chain_job_id(fields: dict[str, str]) -> str:
    """The id a chain records for the job of ``scontrol`` ``fields``: ``<array id>_<task id>``
    for one task of an array (its JobId is a number of the task's own), else JobId."""
    task = fields.get("ArrayTaskId", "")
    if task.isdigit() and fields.get("ArrayJobId"):
        return f"{fields['ArrayJobId']}_{task}"
    return fields.get("JobId", "")


def show_job(job_id: str) -> dict[str, str]:
    """``scontrol show job -o`` as a dict; empty when SLURM has forgotten the job."""
    return job_fields(query_jobs(["scontrol", "show", "job", "-o", job_id]))


def show_jobs(job_ids: list[str]) -> dict[str, dict[str, str]]:
    """``scontrol show job -o`` of several jobs in one call (every job the controller still
    remembers, kept where its id is asked for): each one's fields by id; a lone id is asked
    for by itself."""
    if len(job_ids) <= 1:
        return {job_id: fields for job_id in job_ids if (fields := show_job(job_id))}
    wanted = set(job_ids)
    found = {}
    for line in query_jobs(["scontrol", "show", "job", "-o"]).splitlines():
        fields = job_fields(line)
        if (job_id := chain_job_id(fields)) in wanted:
            found[job_id] = fields
    return found


# The cluster's limits that decide whether a sweep's arrays can be queued (slurm.conf).
ARRAY_LIMITS = ("MaxArraySize", "MaxJobCount")


def array_limits() -> dict[str, int]:
    """MaxArraySize and MaxJobCount as ``scontrol show config`` gives them, and ``queued``: the
    jobs in the queue now (an array's pending tasks one each, as they will count)."""
    limits: dict[str, int] = {}
    for line in run_slurm(["scontrol", "show", "config"], timeout_s=QUERY_TIMEOUT_S).splitlines():
        name, _, value = line.partition("=")
        if name.strip() in ARRAY_LIMITS and value.strip().isdigit():
            limits[name.strip()] = int(value.strip())
    queue = run_slurm(["squeue", "--noheader", "--array", "--format=%i"], timeout_s=QUERY_TIMEOUT_S)
    limits["queued"] = len(queue.splitlines())
    return limits


def probe_partitions() -> list[Partition] | None:
    """The cluster's partitions, or None when no SLURM controller answers.

    One sinfo call answers both "is there a SLURM?" and "what can it run?" for a launch.
    """
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return None
    try:
        completed = subprocess.run(
            ["sinfo", "--noheader", f"--format={PARTITION_FORMAT}"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_partitions(completed.stdout) if completed.returncode == 0 else None


def run_slurm(
    argv: Sequence[str],
    *,
    timeout_s: float = 60,
    idempotent: bool = True,
    transient_markers: Sequence[str] = TRANSIENT_MARKERS,
    attempts: int | None = None,
    env: dict[str, str] | None = None,
) -> str:
    """Run a SLURM command and return its stdout; raise SchedulerError with its own message.
    A transient failure is tried again: ``attempts`` times, or (by default) for as long as
    ``orchestrator.retry.patience_s()`` allows, one line on stderr per retry."""
    return with_retries(
        lambda: run_slurm_once(argv, timeout_s=timeout_s, env=env),
        transient_markers=transient_markers,
        idempotent=idempotent,
        attempts=attempts,
        announce=say_retry if attempts is None else None,
    )


def say_retry(line: str) -> None:
    print(f"[orch] {line}", file=sys.stderr, flush=True)


def run_slurm_once(
    argv: Sequence[str], *, timeout_s: float, env: dict[str, str] | None = None
) -> str:
    """One try of a SLURM command: its stdout, or a SchedulerError (SchedulerTimeout) saying why."""
    try:
        completed = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout_s, env=env
        )
    except FileNotFoundError as error:
        raise SchedulerError(f"{argv[0]} not found: is SLURM installed? ({error})") from error
    except subprocess.TimeoutExpired as error:
        raise SchedulerTimeout(
            f"{argv[0]} failed: it did not answer within {timeout_s:.0f} s"
        ) from error
    if completed.returncode != 0:
        message = (completed.stderr or completed.stdout).strip() or f"exit {completed.returncode}"
        raise SchedulerError(f"{argv[0]} failed: {message}")
    return completed.stdout


def controller_problem(env: dict[str, str] | None = None) -> str | None:
    """None when slurmctld answers ``scontrol ping``; otherwise why not, in one line.

    A dead controller is reported at once (its port refuses), so callers learn within
    QUERY_TIMEOUT_S whether to ask the queue or fall back to accounting and the run dir.
    """
    try:
        output = run_slurm_once(["scontrol", "ping"], timeout_s=QUERY_TIMEOUT_S, env=env)
    except SchedulerError as error:
        return str(error).splitlines()[0].removeprefix("scontrol failed: ")
    if " is UP" in output:
        return None
    return (output.strip().splitlines() or ["scontrol ping gave no answer"])[0]
