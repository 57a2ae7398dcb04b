"""A chain's status as ``status`` and ``list`` show it, true on every backend.

A chain that has ended keeps the status its judgement gave it (orchestrator/chain_judgement.py:
complete, failed, blocked, ...). Until then the manifest says ``submitted``, and the status is
read from its jobs: ``running`` while one runs, ``queued`` while one waits, and once every job
has ended without a judgement (a .sub that never calls the chain hook, a job killed before its
end hook ran), how the last of them ended: ``complete``, ``failed`` with why (the trainer's
``error:`` line from its end-of-job record, else the state, exit code and signal), or
``cancelled``.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

from contract.job_end import read_job_end
from contract.slurm_states import has_ended
from orchestrator.backends.base import JobStatus
from orchestrator.manifest import (
    CANCELLED,
    COMPLETE,
    FAILED,
    QUEUED,
    RUNNING,
    SUBMITTED,
    JobRecord,
    Manifest,
)

# A job not yet started, as the scheduler or the run dir (backends/run_dir.py) says.
WAITING_STATES = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "NOT_STARTED")


@dataclass(frozen=True)
class ChainStatus:
    status: str
    why: str | None = None  # for an ended chain: how it ended, in a line


def run_order(job: JobRecord) -> tuple[float, int]:
    """Jobs in the order they were submitted: a local chain runs a replacement at once, before
    the planned jobs after it, which have lower indexes."""
    return (job.submit_time or 0.0, job.index)


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def exit_words(code: int | None) -> str:
    """`` (exit 137: SIGKILL)``: an exit status as the lines say it, a signal by its name."""
    if code is None:
        return ""
    killed = f": {signal_name(code - 128)}" if code > 128 else ""
    return f" (exit {code}{killed})"


def trainer_error(run_dir: str, job: JobRecord) -> str | None:
    """The trainer's ``error:`` line for ``job``, from its end-of-job record."""
    record = read_job_end(Path(run_dir), str(job.index), str(job.job_id))
    return record.get("error") if record else None


def chain_status(manifest: Manifest, statuses: dict[str, JobStatus]) -> ChainStatus:
    """The chain's status now, from its manifest and its jobs' ``statuses``."""
    if manifest.status != SUBMITTED:
        return ChainStatus(manifest.status, manifest.ended)
    states = {
        job.index: statuses[str(job.job_id)].state if str(job.job_id) in statuses else "UNKNOWN"
        for job in manifest.jobs
    }
    live = [
        states[job.index]
        for job in manifest.jobs
        if job.outcome is None and not has_ended(states[job.index])
    ]
    if any(state not in WAITING_STATES for state in live):
        return ChainStatus(RUNNING)
    if live:
        return ChainStatus(QUEUED)
    chain_jobs = [job for job in manifest.jobs if not job.then]
    if not chain_jobs:
        return ChainStatus(manifest.status)
    ran = [job for job in chain_jobs if job.outcome != "not_started"]
    last = max(ran or chain_jobs, key=run_order)
    state, which = states[last.index], f"job {last.index} (id {last.job_id}), the last,"
    if last.outcome == "not_started" or (last.outcome is None and state == "CANCELLED"):
        return ChainStatus(CANCELLED, f"{which} was cancelled")
    if last.outcome == "failed" or (last.outcome is None and state != "COMPLETED"):
        said = trainer_error(manifest.run_dir, last)
        status = statuses.get(str(last.job_id))
        why = last.why or f"ended {state}{exit_words(status.exit_code if status else None)}"
        if said and said not in why:
            why += f": error: {said}"
        return ChainStatus(FAILED, f"{which} {why}")
    return ChainStatus(COMPLETE, f"every job ended; {which} {last.why or 'completed'}")
