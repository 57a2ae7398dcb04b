"""submitit's SlurmExecutor as a chain backend (manifest label ``submitit:slurm``).

Job k waits on job k-1 through SLURM's own ``--dependency`` (``singleton`` relies on the chain's
shared job name). A batch script runs in the batch shell itself (no srun around it: the script
calls srun where it wants), its ``#SBATCH`` lines become sbatch parameters that override
submitit's, and the python running it replaces the batch shell (``exec``), so a
``--signal=B:SIG@T`` reaches it and is forwarded to the script, as sbatch would deliver it.
submitit always writes ``--time`` (5 minutes unless ``executor_params`` or the script say
otherwise) and, unless the script names one, ``--signal=USR2@90``. States never come from sacct
(clusters without accounting refuse it): jobs are read with scontrol, then from submitit's result
file once SLURM has forgotten them.
"""

from __future__ import annotations

import shlex
import sys
from typing import Any

from orchestrator.backends.base import JobRequest, JobStatus, dependency_spec
from orchestrator.backends.slurm import Look, SlurmQueue, look
from orchestrator.backends.submitit_common import (
    SubmititBackendBase,
    check_request,
    script_directives,
    update_parameters,
)
from orchestrator.errors import SchedulerError, UsageError
from orchestrator.retry import REJECTED_MARKERS, with_retries
from orchestrator.slurm.commands import say_retry
from orchestrator.slurm.directives import parse_signal

# Options the backend decides itself: the chain's job name (singleton depends on it), submitit's
# log files, the dependency, and the working directory (request.workdir).
OWN_DIRECTIVES = ("job-name", "output", "error", "open-mode", "dependency", "chdir")


class SubmititSlurmBackend(SlurmQueue, SubmititBackendBase):
    label = "submitit:slurm"
    executor = "slurm"
    runs_here = False
    judged = False
    look_at = staticmethod(look)  # the slurm backend's: a command over both kinds looks once

    def submit(self, request: JobRequest) -> str:
        check_request(request)
        directives = script_directives(request)
        params: dict[str, Any] = {**self.executor_params, "job_name": request.job_name}
        dependency = dependency_spec(request.dependency_kind, request.after)
        if dependency:
            params["dependency"] = dependency
        python = None
        if request.script is not None:
            python = f"exec {shlex.quote(sys.executable)}"
            params["use_srun"] = False
            params["additional_parameters"] = {
                **(params.get("additional_parameters") or {}),
                **sbatch_parameters(directives),
            }
        from submitit import SlurmExecutor
        from submitit.core.utils import FailedJobError, FailedSubmissionError

        try:
            executor = SlurmExecutor(self.folder, python=python)
        except RuntimeError as error:
            raise SchedulerError(str(error)) from error
        update_parameters(executor, params)
        payload = self.payload(request, forwarded_signal(directives.get("signal")), False)

        def submit_once() -> str:
            try:
                return executor.submit(payload).job_id
            except (FailedJobError, FailedSubmissionError) as error:
                raise SchedulerError(f"sbatch failed: {str(error).strip()}") from error

        return with_retries(
            submit_once, transient_markers=REJECTED_MARKERS, idempotent=False, announce=say_retry
        )

    def statuses(self, job_ids: list[str], seen: Look | None = None) -> dict[str, JobStatus]:
        """What one look at SLURM (``seen``, or a look taken now) says of each job, as for the
        slurm backend, else submitit's result file; only accounting and the result file while
        the controller does not answer (``unreachable`` says why)."""
        if not job_ids:
            return {}
        seen = seen or look(job_ids)
        self.unreachable = seen.unreachable
        self.accounting_unreachable = seen.accounting_unreachable
        known = "controller unreachable" if self.unreachable else "no longer known to SLURM"
        return {
            job_id: seen.status(job_id)
            or self.result_status(job_id)
            or JobStatus(job_id, "UNKNOWN", reason=f"{known} and no submitit result")
            for job_id in job_ids
        }


def forwarded_signal(spec: str | None) -> tuple[int, int] | None:
    """A ``B:`` signal reaches the python that replaced the batch shell: hand it to the script.

    Without ``B:`` SLURM signals every process of the job, the script's included.
    """
    if not spec:
        return None
    batch_only, number, _grace = parse_signal(spec)
    return (number, number) if batch_only else None


def sbatch_parameters(directives: dict[str, str]) -> dict[str, str | bool]:
    """The script's ``#SBATCH`` options as submitit ``additional_parameters`` (flags as True).

    Names are spelt with underscores, as submitit keys its own, so a directive replaces
    submitit's value for the same option instead of adding a second line.
    """
    if "array" in directives:
        raise UsageError("a chained job cannot be a job array: remove '#SBATCH --array'")
    return {
        name.replace("-", "_"): value or True
        for name, value in directives.items()
        if name not in OWN_DIRECTIVES
    }
