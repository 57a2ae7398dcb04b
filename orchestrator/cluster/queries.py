"""What the cluster's controller says, asked through SLURM's commands with the cluster's conf:
node states and the queue, and emptying it."""

from __future__ import annotations

import os
import time
from pathlib import Path

from orchestrator.cluster.record import COMMAND_TIMEOUT_S
from orchestrator.errors import SchedulerError
from orchestrator.retry import ATTEMPTS
from orchestrator.slurm.commands import run_slurm

DRAIN_TIMEOUT_S = 10.0


def query(argv: list[str], conf: str, retry: bool = True) -> str:
    env = {**os.environ, "SLURM_CONF": conf}
    return run_slurm(argv, timeout_s=COMMAND_TIMEOUT_S, attempts=ATTEMPTS if retry else 1, env=env)


def node_states(conf: Path | str, retry: bool = True) -> dict[str, str]:
    """Each node's state as sinfo reports it (idle, allocated, down*, ...)."""
    argv = ["sinfo", "--noheader", "--Node", "--format=%N %T"]
    output = query(argv, str(conf), retry)
    return dict(line.split(None, 1) for line in output.splitlines() if line.strip())


def queue_job_ids(conf: Path | str) -> list[str]:
    """Ids of the jobs in the cluster's queue (pending, running or completing)."""
    return query(["squeue", "--noheader", "--array", "--format=%i"], str(conf)).split()


def queue_summary(conf: Path | str) -> str:
    """The queue in a few words (``12 RUNNING, 13 PENDING``), or why it could not be read."""
    try:
        output = query(["squeue", "--noheader", "--format=%i %T"], str(conf), retry=False)
    except SchedulerError as error:
        return f"unknown: {error}"
    jobs = [line.strip() for line in output.splitlines() if line.strip()]
    return ", ".join(jobs) if jobs else "empty"


def cancel_all_jobs(conf: Path | str, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
    """scancel everything in the queue and wait until the queue is empty."""
    job_ids = queue_job_ids(conf)
    if job_ids:
        query(["scancel", *job_ids], str(conf))
    deadline = time.monotonic() + timeout_s
    while job_ids and time.monotonic() < deadline:
        time.sleep(0.5)
        job_ids = queue_job_ids(conf)
    if job_ids:
        raise SchedulerError(f"jobs {job_ids} still in the queue {timeout_s:.0f} s after scancel")
