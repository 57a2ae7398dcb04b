"""What the two submitit backends share: the payloads submitit pickles, and the result file.

A job's payload is a batch script (``bash SCRIPT SEED ARGS``) or a Python callable
(``function(seed, *args)``), run with the ORCH_* contract in its environment. ``executor_params``
are the chosen executor's own parameters (SlurmExecutor: ``time``, ``partition``,
``additional_parameters``...; LocalExecutor: ``timeout_min``...). ``request.log_pattern`` is not
used: logs are submitit's own, ``<run dir>/submitit/<job id>_0_log.out`` and ``.err``. Only
submitit's public API is used. submitit is imported where a backend uses it, not with the
module: ``auto_launch`` loads every backend's class to choose one, and submitit alone takes
~0.14 s to import.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from orchestrator.backends.base import DEPENDENCY_KINDS, JobRequest, JobStatus, dependency_spec
from orchestrator.errors import SchedulerError, UsageError
from orchestrator.processes import group_and_descendants, terminate
from orchestrator.slurm.directives import parse_sbatch_directives

FOLDER = "submitit"  # below the run dir


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


class SubmititBackendBase:
    """The half of a submitit backend that does not depend on the executor."""

    option: ClassVar[str] = "submitit"
    auto: ClassVar[bool] = False
    executor: ClassVar[str]  # submitit's executor: slurm | local
    look_at: ClassVar[Callable[[list[str]], Any] | None] = None
    unreachable: str | None = None
    accounting_unreachable: str | None = None

    def __init__(self, folder: Path, executor_params: dict[str, Any] | None = None) -> None:
        self.folder = Path(folder).expanduser().absolute()
        self.executor_params = dict(executor_params or {})

    @classmethod
    def for_run_dir(cls, run_dir: Path) -> SubmititBackendBase:
        return cls(run_dir / FOLDER)

    def set_dependency(self, job_id: str, spec: str) -> None:
        raise SchedulerError(f"the {self.label} backend cannot change job {job_id}'s dependency")

    @staticmethod
    def log_glob(job_id: str) -> str:
        return f"{FOLDER}/{job_id}_*_log.out"

    def command_line(self, request: JobRequest, after: str | None) -> list[str]:
        """A readable account of the submission (submitit has no single command to show)."""
        check_request(request)
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
        spec = dependency_spec(request.dependency_kind, after)
        return [
            "submitit",
            self.executor,
            f"--job-name={request.job_name}",
            *([f"--dependency={spec}"] if spec else []),
            *payload,
        ]

    def test_only(self, request: JobRequest) -> str | None:
        """None: submitit has no dry run (sbatch --test-only is the slurm backend's)."""
        check_request(request)
        return None

    def result(self, job_id: str) -> Any:
        """What a finished callable job returned (None for a script); the job's error otherwise."""
        path = self.result_path(job_id)
        if not path.exists():
            raise SchedulerError(f"job {job_id} has no result (yet): {self.statuses([job_id])}")
        from submitit.core.utils import pickle_load

        outcome, value = pickle_load(path)
        if outcome != "success":
            raise SchedulerError(f"job {job_id} failed:\n{value}")
        return value

    def statuses(self, job_ids: list[str], seen: Any = None) -> dict[str, JobStatus]:
        raise NotImplementedError

    def result_path(self, job_id: str) -> Path:
        from submitit.core.utils import JobPaths

        return JobPaths(self.folder, job_id=job_id, task_id=0).result_pickle

    def result_status(self, job_id: str) -> JobStatus | None:
        """The state submitit's result file (task 0) records, None while there is none.

        The file holds ``("success", value)`` or ``("error", traceback text)``. Only a returned
        value can fail to load here (its module not importable by this process): that is a
        success.
        """
        path = self.result_path(job_id)
        if not path.exists():
            return None
        from submitit.core.utils import pickle_load

        try:
            outcome, value = pickle_load(path)
        except Exception:  # the payload's return value needs imports this process lacks
            return JobStatus(job_id, "COMPLETED", exit_code=0)
        if outcome == "success":
            return JobStatus(job_id, "COMPLETED", exit_code=0)
        lines = str(value).strip().splitlines()
        return JobStatus(job_id, "FAILED", reason=lines[-1] if lines else "")

    def payload(
        self, request: JobRequest, forward: tuple[int, int] | None, own_group: bool
    ) -> Callable[[], Any]:
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
            forward=forward,
            own_group=own_group,
        )


def check_request(request: JobRequest) -> None:
    if (request.script is None) == (request.function is None):
        raise UsageError("a submitit job runs either a script or a Python callable: give one")
    if request.dependency_kind not in DEPENDENCY_KINDS:
        raise UsageError(
            f"dependency {request.dependency_kind!r} is unknown: use one of {DEPENDENCY_KINDS}"
        )


def script_directives(request: JobRequest) -> dict[str, str]:
    if request.script is None:
        return {}
    try:
        return parse_sbatch_directives(request.script.read_text())
    except OSError as error:
        raise UsageError(f"cannot read the batch script {request.script}: {error}") from error


def update_parameters(executor: Any, params: dict[str, Any]) -> None:
    try:
        executor.update_parameters(**params)
    except ValueError as error:
        first_line = str(error).splitlines()[0]
        raise UsageError(f"submitit executor parameters: {first_line}") from error
