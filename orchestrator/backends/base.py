"""The one small interface every backend implements.

A chain is a list of ``JobRequest``s submitted in order; each names the job it waits on. Backends
turn a request into a scheduled job and answer for its state; the chain logic (seeds, manifest,
rollback) lives in ``orchestrator.chain`` and never depends on which backend runs the jobs.
Backends report states in SLURM's vocabulary whatever they run on (``contract.slurm_states``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from orchestrator.errors import SchedulerError

DEPENDENCY_KINDS = ("afterany", "afterok", "singleton")


def dependency_spec(kind: str, after: str | None) -> str | None:
    """SLURM's dependency for a job of a chain: ``singleton``, ``<kind>:<id>``, or None."""
    if kind == "singleton":
        return "singleton"
    return None if after is None else f"{kind}:{after}"


@dataclass(frozen=True)
class JobRequest:
    """One job of a chain, as the backend needs it.

    The payload is a batch script (``script``, run as ``script SEED *script_args``) or, for the
    submitit backend only, a Python callable run as ``function(seed, *function_args)``.
    """

    script: Path | None
    script_args: tuple[str, ...]
    job_name: str
    log_pattern: Path  # may contain %j, replaced by the job id
    env: dict[str, str]  # the ORCH_* contract; values are plain strings
    dependency_kind: str
    after: str | None  # the job id this one waits on (None for the first job)
    workdir: Path
    seed: int
    function: Callable[..., Any] | None = None
    function_args: tuple[Any, ...] = ()
    exclude: str = ""  # nodes the job stays off (sbatch --exclude; orchestrator/slow_nodes.py)


@dataclass
class JobStatus:
    job_id: str
    state: str
    nodes: str = ""
    reason: str = ""
    start_estimate: str = ""
    exit_code: int | None = None
    elapsed: str = ""  # run time so far or in all, as SLURM prints it: [D-]HH:MM:SS
    source: str = ""  # where the state was read: squeue, scontrol, sacct, run dir


class Backend(Protocol):
    """A backend declares what the registry (orchestrator.backends.registry) needs to know."""

    label: ClassVar[str]  # as the manifest records it: slurm, local, submitit:slurm, ...
    option: ClassVar[str]  # the --backend value that picks it
    auto: ClassVar[bool]  # whether --backend auto considers it
    runs_here: ClassVar[bool]  # runs the jobs on this machine rather than through SLURM
    # Its chains are judged as their jobs end (orchestrator/chain_hooks.py): by each job's hook
    # on SLURM, by auto_launch on the local backend; only those replace failed jobs (--retries).
    judged: ClassVar[bool]
    # Why the scheduler did not answer the last statuses() call, whose states then came from
    # accounting or the run dir; None when it answered (or there is no scheduler to ask).
    unreachable: str | None
    # Why accounting (slurmdbd) did not answer the last statuses() call; None when it answered
    # or the cluster keeps none.
    accounting_unreachable: str | None

    @classmethod
    def for_run_dir(cls, run_dir: Path) -> Backend:
        """The backend that looks after (or launches) the chain of ``run_dir``."""

    @staticmethod
    def log_glob(job_id: str) -> str:
        """Where the job's log is, as a glob relative to the chain's run dir."""

    def submit(self, request: JobRequest) -> str:
        """Schedule the job; return its id. Raise SchedulerError with the scheduler's words."""

    def command_line(self, request: JobRequest, after: str | None) -> list[str]:
        """The exact command that submits ``request`` (what --dry-run prints)."""

    def test_only(self, request: JobRequest) -> str | None:
        """Ask the scheduler whether it would accept the job; None where it cannot tell."""

    def cancel(self, job_ids: list[str]) -> None: ...

    # One look at the scheduler for many chains' jobs at once (one query of each kind), handed
    # to each chain's statuses(): backends whose jobs live in the same scheduler share the same
    # function, so a command over many chains looks once; None where a chain is asked alone.
    look_at: ClassVar[Callable[[list[str]], Any] | None]

    def statuses(self, job_ids: list[str], seen: Any = None) -> dict[str, JobStatus]:
        """The jobs' states, from ``seen`` (what ``look_at`` returned) where given."""

    def set_dependency(self, job_id: str, spec: str) -> None:
        """Make a queued job wait on ``spec`` (``dependency_spec``'s form) instead: the chain
        hook's replacement becomes what the ``--then`` job waits for. SchedulerError where the
        backend queues nothing to change."""


class BatchScriptBackend:
    """For backends that run batch scripts only, keep no state of their own and log where
    ``JobRequest.log_pattern`` says: ``RUN_DIR/logs/<name>-<job id>.out``."""

    label: ClassVar[str]
    look_at: ClassVar[Callable[[list[str]], Any] | None] = None
    unreachable: str | None = None
    accounting_unreachable: str | None = None

    @classmethod
    def for_run_dir(cls, run_dir: Path) -> Backend:
        return cls()  # type: ignore[return-value]

    @staticmethod
    def log_glob(job_id: str) -> str:
        return f"logs/*-{job_id}.out"

    def set_dependency(self, job_id: str, spec: str) -> None:
        raise SchedulerError(f"the {self.label} backend cannot change job {job_id}'s dependency")

    @classmethod
    def script_of(cls, request: JobRequest) -> Path:
        if request.script is None:
            raise SchedulerError(
                f"the {cls.label} backend runs batch scripts, not Python callables"
            )
        return request.script
