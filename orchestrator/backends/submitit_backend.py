"""The submitit backend: a chain's jobs through submitit, as batch scripts or Python callables.

Two clusters, one interface:

- ``slurm``: submitit's SlurmExecutor. Job k waits on job k-1 through SLURM's own
  ``--dependency`` (``singleton`` relies on the chain's shared job name). A batch script runs in
  the batch shell itself (no srun around it: the script calls srun where it wants), its
  ``#SBATCH`` lines become sbatch parameters that override submitit's, and the python running it
  replaces the batch shell (``exec``), so a ``--signal=B:SIG@T`` reaches it and is forwarded to
  the script, as sbatch would deliver it. submitit always writes ``--time`` (5 minutes unless
  ``executor_params`` or the script say otherwise) and, unless the script names one,
  ``--signal=USR2@90``.
- ``local``: submitit's LocalExecutor, which has no scheduler. ``submit`` waits until the job the
  request depends on has finished, then starts the job, so a chain runs in order and every
  submission but the first blocks for its predecessor's run time. afterok after a job that did
  not complete starts nothing: the job gets an id ``never-<hex>`` and reads as CANCELLED with
  reason DependencyNeverSatisfied. singleton waits like afterany. A script's ``--time`` becomes
  the local time limit and its ``--signal`` is sent that many seconds before it; other
  directives do not apply to one machine.

``executor_params`` are the chosen executor's own parameters (SlurmExecutor: ``time``,
``partition``, ``additional_parameters``...; LocalExecutor: ``timeout_min``...). States never come
from sacct (clusters without accounting refuse it): slurm jobs are read with scontrol, then from
submitit's result file once SLURM has forgotten them; local jobs from the result file and whether
their controller process still runs. ``request.log_pattern`` is not used: logs are submitit's
own, ``<folder>/<job id>_0_log.out`` and ``.err``.
"""

from __future__ import annotations

import json
import os
import pickletools
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from submitit.core.utils import FailedJobError, FailedSubmissionError, JobPaths, pickle_load
from submitit.local.local import LocalExecutor, LocalJob, LocalJobEnvironment
from submitit.slurm.slurm import SlurmExecutor

from orchestrator.backends.base import DEPENDENCY_KINDS, FINISHED_STATES, JobRequest, JobStatus
from orchestrator.backends.slurm import dependency_option, scontrol_fields, status_from_fields
from orchestrator.errors import SchedulerError, UsageError
from orchestrator.processes import command_line, group_and_descendants, terminate
from orchestrator.retry import REJECTED_MARKERS, with_retries
from orchestrator.sbatch_directives import parse_sbatch_directives, parse_signal
from orchestrator.slurm_commands import run_slurm
from orchestrator.slurm_time import parse_time_minutes

CLUSTERS = ("slurm", "local")
# Options the backend decides itself: the chain's job name (singleton depends on it), submitit's
# log files, the dependency, and the working directory (request.workdir).
OWN_DIRECTIVES = ("job-name", "output", "error", "open-mode", "dependency", "chdir")
NEVER_RUN_SUFFIX = "_dependency_never_satisfied.json"
CANCELLED_SUFFIX = "_cancelled"
POLL_S = 0.5


@dataclass(frozen=True)
class FunctionCall:
    """A Python payload as submitit pickles it: ``function(seed, *args)`` in the contract env."""

    function: Callable[..., Any]
    seed: int
    args: tuple[Any, ...]
    env: dict[str, str]
    workdir: str

    def __call__(self) -> Any:
        os.environ.update(self.env)
        os.chdir(self.workdir)
        return self.function(self.seed, *self.args)


@dataclass(frozen=True)
class ScriptCall:
    """A batch-script payload: ``bash SCRIPT SEED ARGS`` in the job's env plus the contract.

    Not submitit's CommandFunction, which replaces the whole environment when given one (the
    job's SLURM_* variables included), keeps the output in memory and forwards no signal.
    ``forward`` is (signal received, signal sent to the script). ``own_group`` (local) puts the
    script in its own process group so that ending the job ends all of it; under SLURM the job's
    process tracking does that.
    """

    argv: tuple[str, ...]
    env: dict[str, str]
    workdir: str
    forward: tuple[int, int] | None
    own_group: bool

    def __call__(self) -> None:
        process = subprocess.Popen(
            self.argv,
            cwd=self.workdir,
            env={**os.environ, **self.env},
            start_new_session=self.own_group,
        )
        if self.forward is not None:
            received, sent = self.forward
            signal.signal(received, lambda _signum, _frame: process.send_signal(sent))
        try:
            returncode = process.wait()
        finally:
            if self.own_group:
                terminate(group_and_descendants(process.pid))
        if returncode != 0:
            raise subprocess.CalledProcessError(returncode, list(self.argv))


class SubmititBackend:
    """Chains through submitit's executors; see the module docstring for each cluster's rules."""

    name = "submitit"

    def __init__(
        self, folder: Path, cluster: str = "slurm", executor_params: dict[str, Any] | None = None
    ) -> None:
        if cluster not in CLUSTERS:
            raise UsageError(f"submitit cluster {cluster!r} is unknown: use one of {CLUSTERS}")
        self.folder = Path(folder).expanduser().absolute()
        self.cluster = cluster
        self.executor_params = dict(executor_params or {})
        # Local jobs this backend started: their controller processes answer exactly.
        self._local_jobs: dict[str, LocalJob[Any]] = {}

    def command_line(self, request: JobRequest, after: str | None) -> list[str]:
        """A readable account of the submission (submitit has no single command to show)."""
        _check(request)
        if request.function is not None:
            function = request.function
            name = getattr(function, "__qualname__", type(function).__qualname__)
            payload = [
                f"python:{function.__module__}.{name}",
                str(request.seed),
                *(repr(argument) for argument in request.function_args),
            ]
        else:
            payload = ["bash", str(request.script), str(request.seed), *request.script_args]
        return [
            "submitit",
            self.cluster,
            f"--job-name={request.job_name}",
            *dependency_option(request.dependency_kind, after),
            *payload,
        ]

    def test_only(self, request: JobRequest) -> str | None:
        """None: submitit has no dry run (sbatch --test-only is the slurm backend's)."""
        _check(request)
        return None

    def submit(self, request: JobRequest) -> str:
        _check(request)
        directives = _directives(request)
        if self.cluster == "slurm":
            return self._submit_slurm(request, directives)
        return self._submit_local(request, directives)

    def cancel(self, job_ids: list[str]) -> None:
        if self.cluster == "slurm":
            if job_ids:
                run_slurm(["scancel", *job_ids])
            return
        for job_id in job_ids:
            if not self._controller_running(job_id):
                continue
            (self.folder / f"{job_id}{CANCELLED_SUFFIX}").touch()
            if job_id in self._local_jobs:
                self._local_jobs[job_id].cancel()
            else:
                # What LocalJob.cancel sends, for a job another process started.
                os.kill(int(job_id), signal.SIGINT)

    def statuses(self, job_ids: list[str]) -> dict[str, JobStatus]:
        read = self._slurm_status if self.cluster == "slurm" else self._local_status
        return {job_id: read(job_id) for job_id in job_ids}

    def result(self, job_id: str) -> Any:
        """What a finished callable job returned (None for a script); the job's error otherwise."""
        path = self._result_path(job_id)
        if not path.exists():
            raise SchedulerError(f"job {job_id} has no result (yet): {self.statuses([job_id])}")
        outcome, value = pickle_load(path)
        if outcome != "success":
            raise SchedulerError(f"job {job_id} failed:\n{value}")
        return value

    # slurm

    def _submit_slurm(self, request: JobRequest, directives: dict[str, str]) -> str:
        params: dict[str, Any] = {**self.executor_params, "job_name": request.job_name}
        dependency = dependency_option(request.dependency_kind, request.after)
        if dependency:
            params["dependency"] = dependency[0].removeprefix("--dependency=")
        python = None
        if request.script is not None:
            python = f"exec {shlex.quote(sys.executable)}"
            params["use_srun"] = False
            params["additional_parameters"] = {
                **(params.get("additional_parameters") or {}),
                **_sbatch_parameters(directives),
            }
        try:
            executor = SlurmExecutor(self.folder, python=python)
        except RuntimeError as error:
            raise SchedulerError(str(error)) from error
        _update(executor, params)
        payload = self._payload(request, directives)

        def submit_once() -> str:
            try:
                return executor.submit(payload).job_id
            except (FailedJobError, FailedSubmissionError) as error:
                raise SchedulerError(f"sbatch failed: {str(error).strip()}") from error

        return with_retries(submit_once, transient_markers=REJECTED_MARKERS, idempotent=False)

    def _slurm_status(self, job_id: str) -> JobStatus:
        fields = scontrol_fields(job_id)
        if not fields:
            return self._result_status(job_id) or JobStatus(
                job_id, "UNKNOWN", reason="no longer known to SLURM and no submitit result"
            )
        return status_from_fields(job_id, fields)

    # local

    def _submit_local(self, request: JobRequest, directives: dict[str, str]) -> str:
        if request.after is not None:
            previous = self._local_status(request.after)
            while previous.state not in FINISHED_STATES:
                time.sleep(POLL_S)
                previous = self._local_status(request.after)
            if request.dependency_kind == "afterok" and previous.state != "COMPLETED":
                return self._never_run(request.after, previous.state)
        params = dict(self.executor_params)
        if directives.get("time"):
            minutes = parse_time_minutes(directives["time"])
            if minutes is not None:
                params["timeout_min"] = minutes
        if directives.get("signal"):
            params["signal_delay_s"] = int(parse_signal(directives["signal"])[2])
        executor = LocalExecutor(self.folder)
        _update(executor, params)
        job = executor.submit(self._payload(request, directives))
        self._local_jobs[job.job_id] = job
        return job.job_id

    def _never_run(self, after: str, after_state: str) -> str:
        job_id = f"never-{uuid.uuid4().hex[:8]}"
        self.folder.mkdir(parents=True, exist_ok=True)
        record = {"after": after, "after_state": after_state}
        (self.folder / f"{job_id}{NEVER_RUN_SUFFIX}").write_text(json.dumps(record))
        return job_id

    def _local_status(self, job_id: str) -> JobStatus:
        if (self.folder / f"{job_id}{NEVER_RUN_SUFFIX}").exists():
            return JobStatus(job_id, "CANCELLED", reason="DependencyNeverSatisfied")
        # Alive first: the result file is written before the controller exits, never after.
        if self._controller_running(job_id):
            return JobStatus(job_id, "RUNNING", nodes="localhost")
        result = self._result_status(job_id)
        if result is not None:
            return result
        if (self.folder / f"{job_id}{CANCELLED_SUFFIX}").exists():
            return JobStatus(job_id, "CANCELLED")
        return JobStatus(job_id, "FAILED", reason="ended without a result (killed or timed out)")

    def _controller_running(self, job_id: str) -> bool:
        """A local job id is its controller's pid; a zombie or a reused pid does not count.

        A job this backend started is asked through its process handle: just after the start the
        controller's command line may not be readable yet.
        """
        if job_id in self._local_jobs:
            return self._local_jobs[job_id].get_info()["jobState"] == "RUNNING"
        words = command_line(int(job_id)) if job_id.isdigit() else []
        return "submitit.local._local" in words and str(self.folder) in words

    # both

    def _payload(self, request: JobRequest, directives: dict[str, str]) -> Callable[[], Any]:
        if request.function is not None:
            return FunctionCall(
                function=request.function,
                seed=request.seed,
                args=request.function_args,
                env=dict(request.env),
                workdir=str(request.workdir),
            )
        return ScriptCall(
            argv=("bash", str(request.script), str(request.seed), *request.script_args),
            env=dict(request.env),
            workdir=str(request.workdir),
            forward=self._forwarded_signal(directives.get("signal")),
            own_group=self.cluster == "local",
        )

    def _forwarded_signal(self, spec: str | None) -> tuple[int, int] | None:
        """Which signal the running payload gets, and which it hands to the script."""
        if not spec:
            return None
        batch_only, number, _grace = parse_signal(spec)
        if self.cluster == "local":
            return int(LocalJobEnvironment._usr_sig()), number
        return (number, number) if batch_only else None

    def _result_path(self, job_id: str) -> Path:
        return JobPaths(self.folder, job_id=job_id, task_id=0).result_pickle

    def _result_status(self, job_id: str) -> JobStatus | None:
        """The state submitit's result file (task 0) records, None while there is none.

        The file holds ``("success", value)`` or ``("error", traceback)``; its strings are read
        without unpickling, so a status query never imports what the payload returned.
        """
        path = self._result_path(job_id)
        if not path.exists():
            return None
        with path.open("rb") as stream:
            strings = (arg for _op, arg, _pos in pickletools.genops(stream) if isinstance(arg, str))
            outcome = next(strings, "")
            if outcome == "success":
                return JobStatus(job_id, "COMPLETED", exit_code=0)
            traceback_lines = next(strings, "").strip().splitlines()
        return JobStatus(job_id, "FAILED", reason=traceback_lines[-1] if traceback_lines else "")


def _check(request: JobRequest) -> None:
    if (request.script is None) == (request.function is None):
        raise UsageError("a submitit job runs either a script or a Python callable: give one")
    if request.dependency_kind not in DEPENDENCY_KINDS:
        raise UsageError(
            f"dependency {request.dependency_kind!r} is unknown: use one of {DEPENDENCY_KINDS}"
        )


def _directives(request: JobRequest) -> dict[str, str]:
    if request.script is None:
        return {}
    try:
        return parse_sbatch_directives(request.script.read_text())
    except OSError as error:
        raise UsageError(f"cannot read the batch script {request.script}: {error}") from error


def _sbatch_parameters(directives: dict[str, str]) -> dict[str, str | bool]:
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


def _update(executor: SlurmExecutor | LocalExecutor, params: dict[str, Any]) -> None:
    try:
        executor.update_parameters(**params)
    except ValueError as error:
        first_line = str(error).splitlines()[0]
        raise UsageError(f"submitit executor parameters: {first_line}") from error
