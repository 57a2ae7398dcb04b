"""submitit's LocalExecutor as a chain backend (manifest label ``submitit:local``).

The LocalExecutor has no scheduler. ``submit`` waits until the job the request depends on has
finished, then starts the job, so a chain runs in order and every submission but the first blocks
for its predecessor's run time. afterok after a job that did not complete starts nothing: the job
gets an id ``never-<hex>`` and reads as CANCELLED with reason DependencyNeverSatisfied. singleton
waits like afterany. A script's ``--time`` becomes the local time limit and its ``--signal`` is
sent that many seconds before it; other directives do not apply to one machine. A job id is the
pid of submitit's controller process: states come from the result file and whether that process
still runs.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from contract.slurm_states import has_ended
from orchestrator.backends.base import JobRequest, JobStatus
from orchestrator.backends.submitit_common import (
    SubmititBackendBase,
    check_request,
    script_directives,
    update_parameters,
)
from orchestrator.processes import alive, command_line, terminate, with_descendants
from orchestrator.slurm.directives import parse_signal
from orchestrator.slurm.time_limit import parse_time_minutes

if TYPE_CHECKING:
    from submitit import LocalJob

# How long a cancelled job's controller gets to stop its task on SIGINT (it takes ~1 s) before
# the backend ends the job's processes itself.
CANCEL_GRACE_S = 3.0
NEVER_RUN_SUFFIX = "_dependency_never_satisfied.json"
CANCELLED_SUFFIX = "_cancelled"
POLL_S = 0.5


class SubmititLocalBackend(SubmititBackendBase):
    label = "submitit:local"
    executor = "local"
    runs_here = True
    judged = False

    def __init__(self, folder: Path, executor_params: dict[str, Any] | None = None) -> None:
        super().__init__(folder, executor_params)
        # Jobs this backend started: their controller processes answer exactly.
        self._jobs: dict[str, LocalJob[Any]] = {}

    def submit(self, request: JobRequest) -> str:
        from submitit import JobEnvironment, LocalExecutor

        check_request(request)
        directives = script_directives(request)
        if request.after is not None:
            previous = self._status(request.after)
            while not has_ended(previous.state):
                time.sleep(POLL_S)
                previous = self._status(request.after)
            if request.dependency_kind == "afterok" and previous.state != "COMPLETED":
                return self._never_run(request.after, previous.state)
        params = dict(self.executor_params)
        if directives.get("time"):
            minutes = parse_time_minutes(directives["time"])
            if minutes is not None:
                params["timeout_min"] = minutes
        forward = None
        if directives.get("signal"):
            _batch_only, number, grace = parse_signal(directives["signal"])
            params["signal_delay_s"] = int(grace)
            # The controller warns with submitit's preemption signal; the script gets its own.
            forward = (int(getattr(signal, f"SIG{JobEnvironment.USR_SIG}")), number)
        executor = LocalExecutor(self.folder)
        update_parameters(executor, params)
        job = executor.submit(self.payload(request, forward, own_group=True))
        self._jobs[job.job_id] = job
        return job.job_id

    def cancel(self, job_ids: list[str]) -> None:
        asked = []
        for job_id in job_ids:
            if not self._controller_running(job_id):
                continue
            (self.folder / f"{job_id}{CANCELLED_SUFFIX}").touch()
            if job_id in self._jobs:
                self._jobs[job_id].cancel()
            else:
                # What LocalJob.cancel sends, for a job another process started.
                os.kill(int(job_id), signal.SIGINT)
            asked.append(job_id)
        deadline = time.monotonic() + CANCEL_GRACE_S
        while any(self._controller_running(job_id) for job_id in asked):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        for job_id in asked:
            if self._controller_running(job_id):
                end_controller(int(job_id))

    def statuses(self, job_ids: list[str], seen: Any = None) -> dict[str, JobStatus]:
        return {job_id: self._status(job_id) for job_id in job_ids}

    def _never_run(self, after: str, after_state: str) -> str:
        job_id = f"never-{uuid.uuid4().hex[:8]}"
        self.folder.mkdir(parents=True, exist_ok=True)
        record = {"after": after, "after_state": after_state}
        (self.folder / f"{job_id}{NEVER_RUN_SUFFIX}").write_text(json.dumps(record))
        return job_id

    def _status(self, job_id: str) -> JobStatus:
        if (self.folder / f"{job_id}{NEVER_RUN_SUFFIX}").exists():
            return JobStatus(job_id, "CANCELLED", reason="DependencyNeverSatisfied")
        # Alive first: the result file is written before the controller exits, never after.
        if self._controller_running(job_id):
            return JobStatus(job_id, "RUNNING", nodes="localhost")
        result = self.result_status(job_id)
        cancelled = (self.folder / f"{job_id}{CANCELLED_SUFFIX}").exists()
        if result is not None and not (cancelled and result.state == "FAILED"):
            return result
        if cancelled:  # a script that a cancel ended fails on the way out: still a cancel
            return JobStatus(job_id, "CANCELLED")
        return JobStatus(job_id, "FAILED", reason="ended without a result (killed or timed out)")

    def _controller_running(self, job_id: str) -> bool:
        """Whether the job's controller (its pid is the job id) still runs.

        A job this backend started is asked through its process handle; for another, a live
        process of that pid whose command line names this backend's folder (a reused pid does
        not) counts.
        """
        if job_id in self._jobs:
            return self._jobs[job_id].get_info()["jobState"] == "RUNNING"
        if not job_id.isdigit():
            return False
        return alive(int(job_id)) and str(self.folder) in command_line(int(job_id))


def end_controller(pid: int) -> None:
    """End a job whose controller ignored SIGINT: one started from a process that ignores SIGINT
    (a shell's background job, nohup) inherits that, and Python then installs no handler.
    The script and everything it started get SIGTERM first (a training saves and stops, as on a
    cluster's cancel), then SIGKILL after STOP_TIMEOUT_S; then the task and the controller,
    which pass SIGTERM on without stopping, are killed. No result file: the job reads CANCELLED."""
    try:
        tasks = [task.pid for task in psutil.Process(pid).children()]
    except psutil.Error:
        return
    terminate([child for child in with_descendants(tasks) if child not in tasks])
    terminate([pid, *tasks], timeout_s=1.0)
