"""The slurm backend: sbatch, squeue, scontrol and scancel as subprocesses."""

from __future__ import annotations

import re

from orchestrator.backends.base import BatchScriptBackend, JobRequest, JobStatus, dependency_spec
from orchestrator.errors import SchedulerError
from orchestrator.retry import REJECTED_MARKERS
from orchestrator.slurm_commands import run_slurm

JOB_ID_PATTERN = re.compile(r"^\d+(_\d+)?$")


def dependency_option(kind: str, after: str | None) -> list[str]:
    spec = dependency_spec(kind, after)
    return [] if spec is None else [f"--dependency={spec}"]


def export_option(env: dict[str, str]) -> str:
    """sbatch's --export list; values holding ',' cannot be expressed and are refused upstream."""
    return ",".join(["ALL", *(f"{name}={value}" for name, value in sorted(env.items()))])


class SlurmBackend(BatchScriptBackend):
    label = "slurm"
    option = "slurm"
    auto = True  # when a SLURM controller answers
    runs_here = False

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
            f"--export={export_option(request.env)}",
            str(script),
            str(request.seed),
            *request.script_args,
        ]

    def submit(self, request: JobRequest) -> str:
        output = run_slurm(
            self.command_line(request, request.after),
            idempotent=False,
            transient_markers=REJECTED_MARKERS,
        )
        job_id = output.strip().split(";")[0]
        if not JOB_ID_PATTERN.match(job_id):
            raise SchedulerError(f"sbatch answered {output.strip()!r}, not a job id")
        return job_id

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

    def cancel(self, job_ids: list[str]) -> None:
        if job_ids:
            run_slurm(["scancel", *job_ids])

    def statuses(self, job_ids: list[str]) -> dict[str, JobStatus]:
        """State from squeue for queued jobs, scontrol for recently finished ones."""
        if not job_ids:
            return {}
        found: dict[str, JobStatus] = {}
        queue = run_slurm(
            ["squeue", "--noheader", "--jobs", ",".join(job_ids), "--format=%i|%T|%N|%r|%S"],
            timeout_s=30,
        )
        for line in queue.splitlines():
            job_id, state, nodes, reason, start = (line.split("|") + [""] * 5)[:5]
            found[job_id.strip()] = JobStatus(
                job_id=job_id.strip(),
                state=state.strip(),
                nodes=nodes.strip(),
                reason="" if reason.strip() == "None" else reason.strip(),
                start_estimate=start.strip() if start.strip() not in ("N/A", "") else "",
            )
        for job_id in job_ids:
            if job_id not in found:
                found[job_id] = scontrol_status(job_id)
        return found


def scontrol_fields(job_id: str) -> dict[str, str]:
    """``scontrol show job -o`` as a dict; empty when SLURM has forgotten the job."""
    try:
        output = run_slurm(["scontrol", "show", "job", "-o", job_id], timeout_s=30)
    except SchedulerError as error:
        if "Invalid job id" in str(error):
            return {}
        raise
    fields: dict[str, str] = {}
    for word in output.split():
        name, sep, value = word.partition("=")
        if sep:
            fields[name] = value
    return fields


def status_from_fields(job_id: str, fields: dict[str, str]) -> JobStatus:
    """A JobStatus from ``scontrol show job -o`` fields."""
    exit_code = fields.get("ExitCode", "")
    return JobStatus(
        job_id=job_id,
        state=fields.get("JobState", "UNKNOWN"),
        nodes="" if fields.get("NodeList") == "(null)" else fields.get("NodeList", ""),
        reason="" if fields.get("Reason") == "None" else fields.get("Reason", ""),
        start_estimate=fields.get("StartTime", "").replace("Unknown", ""),
        exit_code=int(exit_code.split(":")[0]) if exit_code[:1].isdigit() else None,
    )


def scontrol_status(job_id: str) -> JobStatus:
    fields = scontrol_fields(job_id)
    return status_from_fields(job_id, fields) if fields else sacct_status(job_id)


def sacct_status(job_id: str) -> JobStatus:
    """Accounting, where the cluster keeps it; clusters without it answer UNKNOWN."""
    try:
        output = run_slurm(
            [
                "sacct",
                "--noheader",
                "--parsable2",
                "-X",
                "-j",
                job_id,
                "--format=State,NodeList,ExitCode",
            ],
            timeout_s=30,
            attempts=1,
        )
    except SchedulerError:
        return JobStatus(job_id=job_id, state="UNKNOWN", reason="no longer known to SLURM")
    lines = [line for line in output.splitlines() if line.strip()]
    if not lines:
        return JobStatus(job_id=job_id, state="UNKNOWN", reason="no longer known to SLURM")
    state, nodes, exit_code = ([*lines[0].split("|"), "", "", ""])[:3]
    return JobStatus(
        job_id=job_id,
        state=state.split()[0],
        nodes=nodes,
        exit_code=int(exit_code.split(":")[0]) if exit_code[:1].isdigit() else None,
    )
