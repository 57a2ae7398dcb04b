"""``orchestrator logs``: print a chain's job logs, or follow them as the jobs run."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from contract.slurm_states import REQUEUE_GRACE_S, has_ended
from orchestrator.backends import registry
from orchestrator.backends.base import Backend
from orchestrator.chain_status import trainer_error
from orchestrator.cli.chain_view import backend_for
from orchestrator.cli.program import say
from orchestrator.errors import UsageError
from orchestrator.manifest import JobRecord, Manifest, find_manifests


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


# Seconds between looks at the scheduler while a log is followed (each look is a few RPCs to
# slurmctld and slurmdbd): the log itself is read every ``poll_s``, and a job's end is seen
# at most this much later. Under REQUEUE_GRACE_S, so a preempted job is looked at again
# before it is given up on.
LOOK_EVERY_S = 2.0


def follow(
    manifest: Manifest,
    job: JobRecord,
    backend: Backend,
    poll_s: float = 0.5,
    requeue_grace_s: float = REQUEUE_GRACE_S,
    look_every_s: float = LOOK_EVERY_S,
) -> None:
    """Stream a job's log until the job has ended and the log has no more to give. A job seen
    PREEMPTED is followed on for ``requeue_grace_s``: requeued, it is PENDING again and runs on
    under the same id. The scheduler is asked at most once every ``look_every_s``, however fast
    the log grows."""
    offset = 0
    preempted_since = None
    looked_at = -math.inf
    state = ""
    while True:
        if time.monotonic() - looked_at >= look_every_s:
            looked_at = time.monotonic()
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
        requeue_possible = (
            preempted_since is not None and time.monotonic() - preempted_since < requeue_grace_s
        )
        if (has_ended(state) and not requeue_possible) or state == "UNKNOWN":
            return
        time.sleep(poll_s)
