"""The slurm backend: sbatch, squeue, scontrol, sacct and scancel as subprocesses.

States are read from the most direct witness that answers: the queue, then accounting (sacct,
where the cluster runs slurmdbd), then scontrol's memory of recent jobs, then the run dir.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from contract.job_env import array_task
from contract.slurm_states import has_ended
from orchestrator.backends.base import (
    BatchScriptBackend,
    JobRequest,
    JobStatus,
    dependency_spec,
)
from orchestrator.backends.run_dir import NOT_STARTED, run_dir_status
from orchestrator.errors import SchedulerError, SchedulerTimeout
from orchestrator.retry import REJECTED_MARKERS, is_transient
from orchestrator.slurm.commands import (
    QUERY_TIMEOUT_S,
    cancel_jobs,
    controller_problem,
    query_jobs,
    run_slurm,
    show_jobs,
    update_dependency,
)

JOB_ID_PATTERN = re.compile(r"^\d+(_\d+)?$")


def dependency_option(kind: str, after: str | None) -> list[str]:
    spec = dependency_spec(kind, after)
    return [] if spec is None else [f"--dependency={spec}"]


def export_option(env: dict[str, str]) -> str:
    """sbatch's --export list; values holding ',' cannot be expressed and are refused upstream."""
    return ",".join(["ALL", *(f"{name}={value}" for name, value in sorted(env.items()))])


@dataclass(frozen=True)
class ArraySubmission:
    """One job array of a sweep's chains (orchestrator/arrays.py): its dispatcher script, the
    task ids (``--array``'s value), what the tasks wait on, and whether it is queued held."""

    script: Path
    job_name: str
    output: Path  # with %A (the array's id) and %a (the task's)
    workdir: Path
    tasks: str
    dependency: str | None
    hold: bool = False


@dataclass(frozen=True)
class Look:
    """What SLURM said of many jobs at one moment: one ``scontrol ping``, one squeue for all of
    them, one sacct for those the queue no longer holds, and one ``scontrol show job`` for those
    accounting has not seen end (recently ended jobs where no accounting is kept). A sweep's
    ``status``, ``list`` and ``cancel`` take one for all their chains, so the scheduler is asked
    the same few questions whatever the number of members."""

    queued: dict[str, JobStatus]
    accounted: dict[str, JobStatus]
    remembered: dict[str, dict[str, str]]  # scontrol's fields by job id
    unreachable: str | None  # why the controller did not answer; None when it did
    accounting_unreachable: str | None  # why slurmdbd did not answer; None when it did

    def status(self, job_id: str) -> JobStatus | None:
        """The job's state from the most direct witness that knew it: the queue, accounting
        where it saw the job end, scontrol's memory; None where none did."""
        status = self.queued.get(job_id) or self.accounted.get(job_id)
        if job_id in self.remembered and not ended(status):
            return status_from_fields(job_id, self.remembered[job_id])
        return status


def look(job_ids: list[str]) -> Look:
    """One look at SLURM for ``job_ids`` (see ``Look``)."""
    unreachable = controller_problem() if job_ids else None
    queued: dict[str, JobStatus] = {}
    if job_ids and unreachable is None:
        try:
            queued = squeue_statuses(job_ids)
        except SchedulerError as error:
            if not isinstance(error, SchedulerTimeout) and not is_transient(str(error)):
                raise
            unreachable = str(error).splitlines()[0]
    rest = [job_id for job_id in job_ids if job_id not in queued]
    accounting_unreachable = None
    try:
        accounted = sacct_statuses(rest)
    except SchedulerError as error:
        accounting_unreachable = sacct_problem(error)
        accounted = {}
    unended = [job_id for job_id in rest if not ended(accounted.get(job_id))]
    remembered = {} if unreachable else show_jobs(unended)
    return Look(queued, accounted, remembered, unreachable, accounting_unreachable)


def ended(status: JobStatus | None) -> bool:
    return status is not None and has_ended(status.state)


class SlurmQueue:
    """What both SLURM backends do to queued jobs: cancel them, and re-point a dependency."""

    def cancel(self, job_ids: list[str]) -> None:
        cancel_jobs(job_ids)

    def set_dependency(self, job_id: str, spec: str) -> None:
        update_dependency(job_id, spec)


class SlurmBackend(SlurmQueue, BatchScriptBackend):
    label = "slurm"
    option = "slurm"
    auto = True  # when a SLURM controller answers
    runs_here = False
    judged = True  # by each job's chain hook
    look_at = staticmethod(look)

    def __init__(self, run_dir: Path | None = None) -> None:
        self.run_dir = run_dir  # where a job's log and metrics tell what SLURM cannot
        self.unreachable: str | None = None
        self.accounting_unreachable: str | None = None

    @classmethod
    def for_run_dir(cls, run_dir: Path) -> SlurmBackend:
        return cls(run_dir)

    def command_line(self, request: JobRequest, after: str | None) -> list[str]:
        script = self.script_of(request)
        return [
            "sbatch",
            "--parsable",
            f"--job-name={request.job_name}",
            f"--output={request.log_pattern}",
            "--open-mode=append",
            f"--chdir={request.workdir}",
            *dependency_option(request.dependency_kind, after),
            *([f"--exclude={request.exclude}"] if request.exclude else []),
            f"--export={export_option(request.env)}",
            str(script),
            str(request.seed),
            *request.script_args,
        ]

    def submit(self, request: JobRequest) -> str:
        return self.accepted(
            run_slurm(
                self.command_line(request, request.after),
                idempotent=False,
                transient_markers=REJECTED_MARKERS,
            )
        )

    @staticmethod
    def accepted(output: str) -> str:
        """The job id ``sbatch --parsable`` answered (``id[;cluster]``)."""
        job_id = output.strip().split(";")[0]
        if not JOB_ID_PATTERN.match(job_id):
            raise SchedulerError(f"sbatch answered {output.strip()!r}, not a job id")
        return job_id

    def array_command_line(self, array: ArraySubmission) -> list[str]:
        """The exact sbatch command that queues ``array``."""
        return [
            "sbatch",
            "--parsable",
            f"--array={array.tasks}",
            f"--job-name={array.job_name}",
            f"--output={array.output}",
            "--open-mode=append",
            f"--chdir={array.workdir}",
            *([f"--dependency={array.dependency}"] if array.dependency else []),
            *(["--hold"] if array.hold else []),
            "--export=ALL",
            str(array.script),
        ]

    def submit_array(self, array: ArraySubmission) -> str:
        """Queue the array; its id (each task's is ``<id>_<task id>``)."""
        return self.accepted(
            run_slurm(
                self.array_command_line(array),
                idempotent=False,
                transient_markers=REJECTED_MARKERS,
            )
        )

    def release(self, job_id: str) -> None:
        """Let a job (or every task of an array) queued with --hold start."""
        run_slurm(["scontrol", "release", job_id])

    def test_only(self, request: JobRequest) -> str | None:
        """sbatch --test-only's verdict (it prints to stderr and exits 0 when the job fits)."""
        argv = self.command_line(request, None)
        argv.insert(1, "--test-only")
        argv.remove("--parsable")
        try:
            run_slurm(argv, attempts=1)
        except SchedulerError as error:
            return f"rejected: {error}"
        return "accepted"

    def statuses(self, job_ids: list[str], seen: Look | None = None) -> dict[str, JobStatus]:
        """Each job's state from the most direct witness of one look at SLURM (``seen``, or a
        look taken now): the queue, then accounting where the queue no longer holds the job,
        then scontrol's memory of recent jobs, then the run dir for what SLURM cannot tell.

        A controller that does not answer ``scontrol ping`` is not queried at all (a dead one
        would make every command wait): states then come from sacct, which slurmdbd answers
        without it, and the run dir, and ``unreachable`` says why. A slurmdbd that does not
        answer leaves scontrol (for MinJobAge) and the run dir: ``accounting_unreachable``.
        """
        if not job_ids:
            return {}
        seen = seen or look(job_ids)
        self.unreachable = seen.unreachable
        self.accounting_unreachable = seen.accounting_unreachable
        if self.unreachable:
            why = f"controller unreachable ({self.unreachable})"
        elif self.accounting_unreachable:
            why = "SLURM no longer knows the job and accounting is unreachable"
        else:
            why = "SLURM no longer knows the job and keeps no accounting"
        return {job_id: seen.status(job_id) or self.unseen(job_id, seen, why) for job_id in job_ids}

    def unseen(self, job_id: str, seen: Look, why: str) -> JobStatus:
        """A job no witness of ``seen`` knew: its run dir's word. An array task cancelled
        before it started leaves no record at all (SLURM only shrinks the array's pending
        range): one the controller no longer queues, with no log, has ended so."""
        status = run_dir_status(self.run_dir, job_id, self.log_glob(job_id), why)
        if status.state == NOT_STARTED and seen.unreachable is None and array_task(job_id):
            reason = "left the queue before it started (SLURM keeps no record of such a task)"
            return JobStatus(job_id, "CANCELLED", reason=reason, source="squeue")
        return status


def squeue_statuses(job_ids: list[str]) -> dict[str, JobStatus]:
    """The jobs among ``job_ids`` that are still in the queue (pending, running, completing)."""
    queue = query_jobs(
        [
            "squeue",
            "--noheader",
            "--array",  # a pending array's tasks one per line, as ``<array id>_<task id>``
            "--jobs",
            ",".join(job_ids),
            "--format=%i|%T|%N|%r|%S|%M",
        ]
    )
    found: dict[str, JobStatus] = {}
    for line in queue.splitlines():
        job_id, state, nodes, reason, start, elapsed = (line.split("|") + [""] * 6)[:6]
        found[job_id.strip()] = JobStatus(
            job_id=job_id.strip(),
            state=state.strip(),
            nodes=nodes.strip(),
            reason="" if reason.strip() == "None" else reason.strip(),
            start_estimate=start.strip() if start.strip() not in ("N/A", "") else "",
            elapsed=elapsed.strip(),
            source="squeue",
        )
    return found


def exit_status(exit_code: str) -> int | None:
    """The exit status of SLURM's ``status:signal`` pair; None when there is none."""
    return int(exit_code.split(":")[0]) if exit_code[:1].isdigit() else None


def status_from_fields(job_id: str, fields: dict[str, str]) -> JobStatus:
    """A JobStatus from ``scontrol show job -o`` fields."""
    return JobStatus(
        job_id=job_id,
        state=fields.get("JobState", "UNKNOWN"),
        nodes="" if fields.get("NodeList") == "(null)" else fields.get("NodeList", ""),
        reason="" if fields.get("Reason") == "None" else fields.get("Reason", ""),
        start_estimate=fields.get("StartTime", "").replace("Unknown", ""),
        exit_code=exit_status(fields.get("ExitCode", "")),
        elapsed=fields.get("RunTime", ""),
        source="scontrol",
    )


# JobID names an array task as ``<array id>_<task id>`` (the id the chain records); JobIDRaw
# is the task's own number, a plain job's id.
SACCT_FORMAT = "JobID,JobIDRaw,State,ExitCode,Elapsed,NodeList,Reason"
# sacct's error on a cluster that keeps no accounting at all: nothing is down there.
NO_ACCOUNTING = "accounting storage is disabled"


def sacct_problem(error: SchedulerError) -> str:
    """sacct's failure in one line: its last (``Problem talking to the database: ...``)."""
    last = str(error).strip().splitlines()[-1]
    return last.removeprefix("sacct failed: ").removeprefix("sacct: error: ")


def sacct_statuses(job_ids: list[str]) -> dict[str, JobStatus]:
    """What accounting recorded for the jobs, in one sacct call; empty where the cluster keeps
    no accounting (sacct: "accounting storage is disabled"). Raises SchedulerError when
    slurmdbd does not answer, for status to say so."""
    if not job_ids:
        return {}
    try:
        output = run_slurm(
            [
                "sacct",
                "--noheader",
                "--parsable2",
                "--allocations",
                "--jobs",
                ",".join(job_ids),
                f"--format={SACCT_FORMAT}",
            ],
            timeout_s=QUERY_TIMEOUT_S,
            attempts=1,
        )
    except SchedulerError as error:
        if NO_ACCOUNTING in str(error):
            return {}
        raise
    found: dict[str, JobStatus] = {}
    wanted = set(job_ids)
    for line in output.splitlines():
        name, raw, state, exit_code, elapsed, nodes, reason = (line.split("|") + [""] * 7)[:7]
        job_id = name if name in wanted else raw
        if job_id not in wanted or not state:
            continue
        found[job_id] = JobStatus(
            job_id=job_id,
            state=state.split()[0],  # "CANCELLED by 0"
            nodes="" if nodes == "None assigned" else nodes,
            reason="" if reason == "None" else reason,
            exit_code=exit_status(exit_code),
            elapsed=elapsed,
            source="sacct",
        )
    return found
