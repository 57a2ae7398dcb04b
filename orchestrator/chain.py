"""A chain: N jobs of one recipe, each depending on the one before, each with its own seed, and
optionally one job of another recipe after the last (``auto_launch --then``), e.g. an evaluation.

Submission is all or nothing. The manifest is saved after every accepted job, so an interrupted
launch never leaves a queued job unrecorded; if any submission fails (or the user interrupts),
the jobs already queued are cancelled and the manifest says why the chain was rolled back.
Once queued, the chain looks after itself: each job's batch script runs the chain hook
(orchestrator.chain_hooks), which ends the chain when training is finished or diverged and
queues replacements for failed jobs (``--retries``).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contract import job_env
from contract.run_dir import LOGS_DIR, log_pattern
from contract.seeds import chain_seeds
from orchestrator.backends.base import Backend, JobRequest, dependency_spec
from orchestrator.errors import SchedulerError, UsageError, prefixed
from orchestrator.launch_checks import (
    check_dependency,
    check_job_name,
    check_max_stalled,
    check_num_jobs,
    check_restarts_in_job,
    check_retries,
    check_run_dir,
    check_slow_nodes,
    parse_exit_codes,
)
from orchestrator.manifest import (
    DEFAULT_MAX_STALLED,
    DEFAULT_RESTARTS_IN_JOB,
    ENDED_STATUSES,
    ROLLED_BACK,
    SUBMITTED,
    SUBMITTING,
    JobRecord,
    Manifest,
    ThenRecord,
    chain_lock,
    orch_home,
    register_chain,
)
from orchestrator.scripts import read_recipe
from orchestrator.seeds import validate_base_seed
from orchestrator.slow_nodes import DEFAULT_EXCLUDE_SLOW_NODES
from orchestrator.slurm.resources import JobResources
from orchestrator.snapshot import (
    DEFAULT_LIMIT_MB,
    SNAPSHOT,
    CodeSource,
    code_env,
    freeze,
    plan_code,
)
from train.checkpoint.location import newest_step
from train.data.storage import StorageError

# The --then job waits for the chain's last job to end, however it ended: a chain that failed or
# timed out still gets its final answer from what it saved.
THEN_DEPENDENCY = "afterany"


@dataclass(frozen=True)
class ThenJob:
    """The one job queued after the chain's last: another recipe, run in the chain's run dir as
    job index ``num_jobs`` with the next seed of the chain's sequence."""

    recipe: Path
    script_text: str
    resources: JobResources
    option: str  # how the user gave it (--then, hydra.launcher.then), to name it in errors
    programs: tuple[str, ...] = ()  # what it starts by name from the PATH (Recipe.programs)

    @property
    def job_name(self) -> str:
        return self.recipe.stem

    @classmethod
    def load(cls, given: str, option: str) -> ThenJob:
        """Check the recipe as the chain's own is checked, before anything is queued."""
        with prefixed(option):
            recipe, prepared = read_recipe(given)
            check_job_name(recipe.stem)
        return cls(recipe, prepared.text, prepared.resources, option, prepared.programs)


@dataclass(frozen=True)
class ChainPlan:
    """Everything decided before the first submission.

    The payload is a batch script (``script_text``, copied into the run dir) or, for the submitit
    backend, a Python callable run as ``function(seed, *function_args)``; ``recipe`` is the file
    the payload came from (the script, or the callable's source file), hashed into the manifest.
    """

    chain_id: str
    recipe: Path
    script_text: str | None
    run_dir: Path
    workdir: Path
    num_jobs: int
    seeds: tuple[int, ...]
    dependency_kind: str
    script_args: tuple[str, ...]
    base_seed: int | None
    job_name: str
    sweep_id: str | None = None
    function: Callable[..., Any] | None = None
    function_args: tuple[Any, ...] = ()
    then: ThenJob | None = None
    retries: int = 0
    retry_on_exit: tuple[int, ...] = ()  # exit codes worth a replacement (besides the transient)
    max_stalled: int = DEFAULT_MAX_STALLED
    restarts_in_job: int = DEFAULT_RESTARTS_IN_JOB
    exclude_slow_nodes: int = DEFAULT_EXCLUDE_SLOW_NODES  # orchestrator/slow_nodes.py
    readmit_slow_nodes: int = 0
    code: CodeSource | None = None  # what the jobs run (None: the live workdir, unrecorded)

    @classmethod
    def create(
        cls,
        *,
        job_name: str,
        recipe: Path,
        num_jobs: int,
        dependency_kind: str,
        base_seed: int | None,
        run_dir: Path | None,
        script_text: str | None = None,
        script_args: tuple[str, ...] = (),
        chain_id: str | None = None,
        sweep_id: str | None = None,
        function: Callable[..., Any] | None = None,
        function_args: tuple[Any, ...] = (),
        workdir: Path | None = None,
        then: ThenJob | None = None,
        retries: int = 0,
        retry_on_exit: str = "",
        max_stalled: int = DEFAULT_MAX_STALLED,
        restarts_in_job: int = DEFAULT_RESTARTS_IN_JOB,
        exclude_slow_nodes: int = DEFAULT_EXCLUDE_SLOW_NODES,
        readmit_slow_nodes: int = 0,
        code: str = SNAPSHOT,
        code_limit_mb: float = DEFAULT_LIMIT_MB,
        code_source: CodeSource | None = None,
    ) -> ChainPlan:
        """The one way to plan a chain: every check made, the id, run dir and seeds decided.

        ``run_dir`` defaults to ``$ORCH_HOME/runs/<chain id>``, ``workdir`` to the current one.
        A --then job takes the seed after the chain's last, derived the same way. ``code``:
        what the jobs run (``orchestrator.snapshot``: by default a snapshot of the git work
        tree holding ``workdir``, frozen into the run dir at submission; the jobs start in its
        copy of ``workdir``). ``code_source``: code planned already, which the members of a
        sweep share (one snapshot, frozen once).
        """
        check_num_jobs(num_jobs)
        check_dependency(dependency_kind)
        if base_seed is not None:
            validate_base_seed(base_seed)
        check_job_name(job_name)
        check_retries(retries, dependency_kind, script_text)
        exit_codes = parse_exit_codes(retry_on_exit, retries)
        check_max_stalled(max_stalled)
        check_restarts_in_job(restarts_in_job)
        check_slow_nodes(exclude_slow_nodes, readmit_slow_nodes)
        chain_id = chain_id or new_chain_id(job_name)
        resolved_run_dir = (run_dir or orch_home() / "runs" / chain_id).expanduser().resolve()
        check_run_dir(resolved_run_dir)
        source = code_source or plan_code(
            code, workdir or Path.cwd(), resolved_run_dir, code_limit_mb
        )
        return cls(
            chain_id=chain_id,
            recipe=recipe,
            script_text=script_text,
            run_dir=resolved_run_dir,
            workdir=source.workdir,
            num_jobs=num_jobs,
            seeds=tuple(chain_seeds(num_jobs + (then is not None), base_seed)),
            dependency_kind=dependency_kind,
            script_args=tuple(script_args),
            base_seed=base_seed,
            job_name=job_name,
            sweep_id=sweep_id,
            function=function,
            function_args=tuple(function_args),
            then=then,
            retries=retries,
            retry_on_exit=exit_codes,
            max_stalled=max_stalled,
            restarts_in_job=restarts_in_job,
            exclude_slow_nodes=exclude_slow_nodes,
            readmit_slow_nodes=readmit_slow_nodes,
            code=source,
        )

    @property
    def script_path(self) -> Path:
        """The copy of the script that every job of the chain runs (immune to later edits)."""
        return self.run_dir / f"{self.job_name}.sub"

    @property
    def then_script_path(self) -> Path:
        """The --then job's copy; prefixed, so a recipe of the chain's name cannot overwrite it."""
        assert self.then is not None
        return self.run_dir / f"then-{self.then.job_name}.sub"

    @property
    def total_jobs(self) -> int:
        """The chain's jobs and its --then job."""
        return self.num_jobs + (self.then is not None)

    def script_copies(self) -> list[tuple[int, Path, str]]:
        """(first job index that runs it, path in the run dir, text) of each batch script."""
        copies: list[tuple[int, Path, str]] = []
        if self.script_text is not None:
            copies.append((0, self.script_path, self.script_text))
        if self.then is not None:
            copies.append((self.num_jobs, self.then_script_path, self.then.script_text))
        return copies

    def is_then(self, index: int) -> bool:
        return self.then is not None and index == self.num_jobs

    def request(self, index: int, after: str | None) -> JobRequest:
        """Job ``index``; the last index of a plan with a --then job is that job."""
        if self.then is not None and index == self.num_jobs:
            return JobRequest(
                script=self.then_script_path,
                script_args=(),
                job_name=self.then.job_name,
                log_pattern=log_pattern(self.run_dir, self.then.job_name),
                env=contract_env(self, index),
                dependency_kind=THEN_DEPENDENCY,
                after=after,
                workdir=self.workdir,
                seed=self.seeds[index],
            )
        return JobRequest(
            script=self.script_path if self.function is None else None,
            script_args=self.script_args,
            job_name=self.job_name,
            log_pattern=log_pattern(self.run_dir, self.job_name),
            env=contract_env(self, index),
            dependency_kind=self.dependency_kind,
            after=after,
            workdir=self.workdir,
            seed=self.seeds[index],
            function=self.function,
            function_args=self.function_args,
        )


def starting_step(run_dir: Path) -> int | None:
    """The step a chain on ``run_dir`` starts from: its newest complete checkpoint, wherever
    the run keeps them (a bucket that does not answer is one line, nothing queued)."""
    try:
        return newest_step(run_dir)
    except StorageError as error:
        raise UsageError(f"run dir {run_dir}'s checkpoints: {error}") from None


def contract_env(plan: ChainPlan, index: int) -> dict[str, str]:
    """The ORCH_* variables of the .sub contract for job ``index``.

    ORCH_NUM_JOBS counts the chain's jobs without the --then job, whose index is that number.
    """
    env = job_variables(
        plan.chain_id, index, plan.num_jobs, plan.seeds[index], plan.run_dir, plan.sweep_id
    )
    if plan.code is not None:
        env.update(plan.code.env(os.environ.get("PYTHONPATH")))
    return env


def job_variables(
    chain_id: str, index: int, num_jobs: int, seed: int, run_dir: Path | str, sweep_id: str | None
) -> dict[str, str]:
    """The ORCH_* variables of one job; ORCH_PYTHON is the interpreter that runs the chain hook
    (this one: the orchestrator is installed in it)."""
    env = {
        job_env.CHAIN_ID: chain_id,
        job_env.JOB_INDEX: str(index),
        job_env.NUM_JOBS: str(num_jobs),
        job_env.SEED: str(seed),
        job_env.RUN_DIR: str(run_dir),
        job_env.PYTHON: sys.executable,
    }
    if sweep_id:
        env[job_env.SWEEP_ID] = sweep_id
    return env


def replacement_request(
    manifest: Manifest, index: int, seed: int, after: str | None, exclude: str = ""
) -> JobRequest:
    """Job ``index`` of a submitted chain re-running its recipe: what the chain hook queues
    for a failed job. It runs the chain's script copy, as every job of the chain does, off
    the nodes of ``exclude`` (the recipe's own and the slow ones the chain leaves out)."""
    script = Path(manifest.script)
    job_name = script.stem  # ChainPlan.script_path is RUN_DIR/<job name>.sub
    env = job_variables(
        manifest.chain_id, index, manifest.num_jobs, seed, manifest.run_dir, manifest.sweep_id
    )
    if manifest.code_dir:  # the chain's code, whatever the replacing job was started with
        env.update(code_env(manifest.code_dir, os.environ.get("PYTHONPATH")))
    return JobRequest(
        script=script,
        script_args=tuple(manifest.args),
        job_name=job_name,
        log_pattern=log_pattern(Path(manifest.run_dir), job_name),
        env=env,
        dependency_kind=manifest.dependency_kind,
        after=after,
        workdir=Path(manifest.workdir or manifest.run_dir),
        seed=seed,
        exclude=exclude,
    )


def new_chain_id(stem: str) -> str:
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in stem)[:40] or "chain"
    return f"{safe}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def callable_name(function: Callable[..., Any]) -> str:
    return f"python:{function.__module__}.{function.__qualname__}"


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def new_manifest(plan: ChainPlan, backend_name: str) -> Manifest:
    then = None
    if plan.then is not None:
        then = ThenRecord(
            recipe=str(plan.then.recipe),
            recipe_sha256=sha256_of(plan.then.recipe),
            script=str(plan.then_script_path),
        )
    code = plan.code
    return Manifest(
        chain_id=plan.chain_id,
        recipe=str(plan.recipe),
        recipe_sha256=sha256_of(plan.recipe),
        script=str(plan.script_path) if plan.function is None else callable_name(plan.function),
        run_dir=str(plan.run_dir),
        backend=backend_name,
        dependency_kind=plan.dependency_kind,
        num_jobs=plan.num_jobs,
        args=list(plan.script_args),
        base_seed=plan.base_seed,
        git_sha=code.commit if code else None,
        git_dirty=code.dirty if code else None,
        created=time.time(),
        sweep_id=plan.sweep_id,
        then=then,
        retries=plan.retries,
        retry_on_exit=list(plan.retry_on_exit),
        max_stalled=plan.max_stalled,
        restarts_in_job=plan.restarts_in_job,
        exclude_slow_nodes=plan.exclude_slow_nodes,
        readmit_slow_nodes=plan.readmit_slow_nodes,
        start_step=starting_step(plan.run_dir),
        workdir=str(plan.workdir),
        code_mode=code.mode if code else None,
        code_dir=str(code.root) if code and code.root else None,
        code_diff=str(code.diff_path) if code and code.diff_path else None,
    )


# What a backend that runs each job to its end in ``submit`` (the local one) calls after each:
# the chain's judgement (orchestrator.chain_hooks.judge_local_job), which may end the chain.
JudgeJob = Callable[[Manifest, JobRecord, Backend], None]


def submit_chain(
    plan: ChainPlan,
    backend: Backend,
    on_submitted: Callable[[JobRecord], None] | None = None,
    judge: JudgeJob | None = None,
) -> Manifest:
    """Submit every job of the plan in order; roll back the chain if any submission fails.

    The chain lock is held throughout: a job that ends meanwhile runs its chain hook only once
    the manifest is whole. The local backend's jobs leave the manifest alone: ``judge`` does
    their part here, and once it has ended the chain the planned jobs after it do not run (the
    --then job still does).
    """
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    (plan.run_dir / LOGS_DIR).mkdir(exist_ok=True)
    with chain_lock(plan.run_dir):
        return _submit_chain(plan, backend, on_submitted, judge)


def _submit_chain(
    plan: ChainPlan,
    backend: Backend,
    on_submitted: Callable[[JobRecord], None] | None,
    judge: JudgeJob | None,
) -> Manifest:
    if plan.code is not None:
        freeze(plan.code)
    write_scripts(plan)
    manifest = new_manifest(plan, backend.label)
    manifest.save(durable=False)
    register_chain(manifest)
    _submit_jobs(plan, backend, manifest, on_submitted, judge)
    if manifest.status == SUBMITTING:
        manifest.status = SUBMITTED
    manifest.save()
    return manifest


def write_scripts(plan: ChainPlan) -> None:
    """The copies of the scripts the jobs run, in the run dir."""
    for _index, path, text in plan.script_copies():
        path.write_text(text)
        path.chmod(0o755)


def _submit_jobs(
    plan: ChainPlan,
    backend: Backend,
    manifest: Manifest,
    on_submitted: Callable[[JobRecord], None] | None,
    judge: JudgeJob | None = None,
) -> None:
    after: str | None = None
    not_run = 0
    try:
        for index in range(plan.total_jobs):
            if manifest.status in ENDED_STATUSES and not plan.is_then(index):
                not_run += 1
                continue
            request = plan.request(index, after)
            job_id = backend.submit(request)
            record = JobRecord(
                index=index,
                seed=request.seed,
                job_id=job_id,
                dependency=dependency_spec(request.dependency_kind, after),
                submit_time=time.time(),
                then=plan.is_then(index),
            )
            manifest.record_job(record)
            if on_submitted is not None:
                on_submitted(record)
            if judge is not None:
                judge(manifest, record, backend)
            after = manifest.jobs[-1].job_id  # a replacement the judgement ran comes last
    except KeyboardInterrupt as error:
        rollback(manifest, backend, error)
        raise
    except SchedulerError as error:
        said = rollback(manifest, backend, error)
        raise SchedulerError(
            f"submitting job {len(manifest.jobs) + 1} of {plan.total_jobs} failed: {error}. "
            f"{said} Run the same auto_launch again once SLURM answers (`scontrol ping`)."
        ) from error
    if not_run:
        manifest.ended = f"{manifest.ended}; {not_run} more planned job(s) not run"


def last_first(job_ids: list[str]) -> list[str]:
    """A chain's jobs in the order to cancel them: a job waiting (afterany) on one being
    cancelled must be gone before that one ends, or the scheduler may start it in between."""
    return job_ids[::-1]


def rollback(manifest: Manifest, backend: Backend, error: BaseException) -> str:
    """Cancel what this chain queued and record why; the chain is never left half-submitted:
    a job the cancel could not reach (the controller down) finds the chain rolled back as it
    starts and does not train (orchestrator.chain_hooks). What became of the queued jobs, in a
    sentence."""
    queued = manifest.job_ids()
    try:
        backend.cancel(last_first(queued))
        said = f"The chain is rolled back: its {len(queued)} queued job(s) are cancelled."
    except SchedulerError as failure:
        said = (
            f"The chain is rolled back, but cancelling its {len(queued)} queued job(s) "
            f"({' '.join(queued)}) failed too ({str(failure).splitlines()[0]}): they will not "
            "train (each finds the "
            "chain rolled back as it starts); `scancel` them once SLURM answers."
        )
    manifest.status = ROLLED_BACK
    reason = str(error) or type(error).__name__
    manifest.error = f"{reason}. {said}"
    manifest.save()
    return said
