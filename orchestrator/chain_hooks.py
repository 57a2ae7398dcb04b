"""The chain hook: what each job's batch script runs so that a queued chain looks after itself,
with no orchestrator process alive.

    "$ORCH_PYTHON" -m orchestrator.chain_hooks start        first thing in the job
    "$ORCH_PYTHON" -m orchestrator.chain_hooks end STATUS   after the training exited (STATUS)
    python -m orchestrator.chain_hooks check RUN_DIR        by hand, e.g. after the last job died

It reads ORCH_RUN_DIR, ORCH_CHAIN_ID and SLURM_JOB_ID (plus SLURM_CONF where SLURM needs it),
and acts on chains of the slurm backend only. Holding the run dir's chain lock, it judges each
ended job of the chain once (its ``outcome`` in the manifest is the idempotency key) from the
trainer's end-of-job record (contract/job_end.py), the launcher's exit status or SLURM's state:

- finished (max_steps): the chain is complete; its queued jobs are cancelled while pending;
- diverged: the chain stops the same way, its reason in the manifest; no retry is spent;
- blocked (the trainer's exit 2, config refused, or 4, checkpoints cannot be saved): a new job
  would fail the same way, so the chain stops the same way too; no retry is spent;
- stopped (a signal or a budget, after saving) or completed (exit 0, no record): nothing to do;
- failed (an error, or no record and a non-zero status, or killed without running ``end``):
  one replacement job is queued at the end of the chain while ``--retries`` allow.

``end`` covers a job that lives to run it; a job killed with its batch shell (node failure,
SIGKILL, the time limit) is judged by ``start`` of the next job of the chain, which afterany
starts anyway. ``start`` exits EXIT_CHAIN_ENDED when the chain is already complete,
diverged or blocked: the job must then exit 0 without training. ``end`` prints the job's
outcome as the log's last line (orchestrator/backends/run_dir.py reads it).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contract import job_env
from contract.job_end import (
    EXIT_CHAIN_ENDED,
    EXIT_CONFIG,
    EXIT_NOT_SAVED,
    outcome_line,
    read_job_end,
)
from contract.slurm_states import END_STATES, ENDING_STATES
from orchestrator.backends import registry
from orchestrator.backends.base import dependency_spec
from orchestrator.chain import THEN_DEPENDENCY, last_first, replacement_request
from orchestrator.manifest import MANIFEST_NAME, JobRecord, Manifest, chain_lock
from orchestrator.seeds import chain_seeds

ACTIVE_BACKEND = "slurm"  # the backend whose chains the hook looks after
# A job has ended, or is ending (its dependants may already start).
ENDED_STATES = END_STATES + ENDING_STATES
# What SLURM sets for the job the hook runs in: the replacement it submits must not inherit it.
JOB_ONLY_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "GPU_DEVICE_ORDINAL",
)
JOB_ONLY_PREFIXES = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_")
KEPT_VARIABLES = ("SLURM_CONF",)  # which cluster to talk to


# Trainer exits a new job would only repeat: no replacement is queued for them.
BLOCKED = {
    EXIT_CONFIG: "the trainer's config or layout is refused",
    EXIT_NOT_SAVED: "checkpoints cannot be saved (the run dir's disk is full or read-only)",
}
# Outcomes that end the whole chain (its queued jobs are cancelled), and the status each gives it.
CHAIN_ENDINGS = {"finished": "complete", "diverged": "diverged", "blocked": "blocked"}


@dataclass(frozen=True)
class Ending:
    """What a job's end means for the chain: an outcome word and one line saying why."""

    outcome: str  # finished, stopped, completed, failed, blocked, diverged, not_started
    detail: str


def say(line: str) -> None:
    print(f"[orch] chain: {line}", flush=True)


def judge(record: dict[str, Any] | None, status: int | None, state: str, started: bool) -> Ending:
    """The ending of one job: ``record`` is its end-of-job record, ``status`` the launcher's exit
    status (known to ``end`` only), ``state`` SLURM's, ``started`` whether it has a log."""
    if record is not None:
        step = record.get("step")
        if record.get("finished"):
            return Ending("finished", f"training finished at step {step}")
        if record["reason"] == "diverged":
            return Ending("diverged", f"training diverged at step {step}")
        if record.get("saved"):
            signalled = record["reason"] == "signal"
            why = record.get("signal") or ("a signal" if signalled else "its budget")
            return Ending("stopped", f"training stopped on {why} after saving step {step}")
        code = record.get("exit_code")
        if code in BLOCKED:
            return Ending(
                "blocked", f"{BLOCKED[code]} (exit {code}); no retry: fix it and queue again"
            )
        return Ending("failed", f"training failed at step {step} (exit {code})")
    if status is not None:
        if status == 0:
            return Ending("completed", "exited with status 0")
        return Ending("failed", f"exited with status {status} and no end-of-job record")
    if state == "CANCELLED" and not started:
        return Ending("not_started", "cancelled before it started")
    if state == "COMPLETED":
        return Ending("completed", "completed")
    return Ending("failed", f"ended {state} without running its end hook")


def scrub_job_environment() -> None:
    """Drop what describes the job this hook runs in, so that sbatch (--export=ALL) does not
    hand it to the replacement. The hook is a process of its own: only it is affected."""
    for name in list(os.environ):
        if name in KEPT_VARIABLES:
            continue
        if name in JOB_ONLY_VARIABLES or name.startswith(JOB_ONLY_PREFIXES):
            del os.environ[name]


class ChainKeeper:
    """One pass of the hook over a chain's manifest, under the chain lock."""

    def __init__(self, manifest: Manifest, current: JobRecord | None) -> None:
        self.manifest = manifest
        self.current = current
        self.run_dir = Path(manifest.run_dir)
        self.backend = registry.for_run_dir(manifest.backend, self.run_dir)

    @property
    def has_ended(self) -> bool:
        return self.manifest.status in CHAIN_ENDINGS.values()

    def judge_current(self, status: int) -> None:
        """``end``: the current job has ended with the launcher's ``status``."""
        job = self.current
        if job is None or job.outcome is not None:
            return
        record = read_job_end(self.run_dir, str(job.index), str(job.job_id))
        self.act([(job, judge(record, status, "", True))], ended_ids=set())

    def judge_earlier(self) -> None:
        """``start``/``check``: every other job of the chain that SLURM says has ended."""
        waiting = [
            job
            for job in self.manifest.jobs
            if job.outcome is None and job.job_id and job is not self.current
        ]
        if not waiting:
            return
        statuses = self.backend.statuses([str(job.job_id) for job in waiting])
        endings = []
        for job in waiting:
            state = statuses[str(job.job_id)].state
            if state not in ENDED_STATES:
                continue
            record = read_job_end(self.run_dir, str(job.index), str(job.job_id))
            started = any(self.run_dir.glob(self.backend.log_glob(str(job.job_id))))
            endings.append((job, judge(record, None, state, started)))
        self.act(endings, ended_ids={str(job.job_id) for job, _ in endings})

    def act(self, endings: list[tuple[JobRecord, Ending]], ended_ids: set[str]) -> None:
        """Record the outcomes (saved before anything is queued or cancelled, so no failure is
        ever replaced twice), then end the chain or queue replacements."""
        if not endings:
            return
        for job, ending in endings:
            job.outcome = ending.outcome
            say(f"job {job.index} (id {job.job_id}) {ending.detail}")
        self.manifest.save()
        for job, ending in endings:
            if job.then or self.has_ended:
                continue
            if ending.outcome in CHAIN_ENDINGS:
                self.end_chain(job, ending)
            elif ending.outcome == "failed":
                self.replace(job, ending, ended_ids)
        self.manifest.save()

    def end_chain(self, job: JobRecord, ending: Ending) -> None:
        """Cancel the chain's queued jobs (the --then job stays: it runs after the chain)."""
        live = [
            other
            for other in self.manifest.jobs
            if other.outcome is None and not other.then and other is not self.current
        ]
        statuses = self.backend.statuses([str(other.job_id) for other in live])
        pending = [other for other in live if statuses[str(other.job_id)].state not in ENDED_STATES]
        ids = [str(other.job_id) for other in pending]
        self.backend.cancel(last_first(ids))
        for other in pending:
            other.outcome = "not_started"
        status = CHAIN_ENDINGS[ending.outcome]
        self.manifest.status = status
        self.manifest.ended = (
            f"job {job.index} (id {job.job_id}): {ending.detail}; "
            f"cancelled {len(ids)} queued job(s){(': ' + ' '.join(ids)) if ids else ''}"
        )
        say(f"chain {status}: {self.manifest.ended}")

    def replace(self, job: JobRecord, ending: Ending, ended_ids: set[str]) -> None:
        """Queue one replacement at the end of the chain, while retries remain."""
        used = sum(other.replaces is not None for other in self.manifest.jobs)
        if used >= self.manifest.retries:
            say(f"job {job.index} is not replaced: {used} of {self.manifest.retries} retries used")
            return
        index = max(other.index for other in self.manifest.jobs) + 1
        tail = max((o for o in self.manifest.jobs if not o.then), key=lambda o: o.index)
        after = None if str(tail.job_id) in ended_ids else str(tail.job_id)
        seed = replacement_seed(self.manifest, index)
        request = replacement_request(self.manifest, index, seed, after)
        job_id = self.backend.submit(request)
        self.manifest.jobs.append(
            JobRecord(
                index=index,
                seed=seed,
                job_id=job_id,
                dependency=dependency_spec(request.dependency_kind, after),
                submit_time=time.time(),
                replaces=job.index,
                reason=ending.detail,
            )
        )
        say(
            f"queued job {index} (id {job_id}, seed {seed}) to replace job {job.index}: "
            f"retry {used + 1} of {self.manifest.retries}"
        )
        self.follow_then_job(job_id)

    def follow_then_job(self, new_tail: str) -> None:
        """The --then job waits for the chain's last job, which is now the replacement."""
        then = next((o for o in self.manifest.jobs if o.then and o.outcome is None), None)
        if then is None:
            return
        spec = f"{THEN_DEPENDENCY}:{new_tail}"
        self.backend.set_dependency(then.job_id, spec)
        then.dependency = spec
        say(f"the --then job (id {then.job_id}) now waits for job {new_tail}")


def replacement_seed(manifest: Manifest, index: int) -> int:
    """Job ``index``'s seed in the chain's sequence (with --seed: what a chain that long would
    have had), else a fresh random one that no job of the chain had."""
    if manifest.base_seed is not None:
        return chain_seeds(index + 1, manifest.base_seed)[index]
    used = {job.seed for job in manifest.jobs}
    while (seed := chain_seeds(1)[0]) in used:
        pass
    return seed


def load_chain(run_dir: Path, chain_id: str | None) -> Manifest | None:
    """The manifest the hook may act on: this chain's (a run dir later reused by another chain
    has that chain's), of the slurm backend, fully submitted."""
    path = run_dir / MANIFEST_NAME
    if not path.is_file():
        say(f"no manifest in {run_dir}: nothing to look after")
        return None
    manifest = Manifest.load(path)
    if chain_id is not None and manifest.chain_id != chain_id:
        say(f"{run_dir} now belongs to chain {manifest.chain_id}: leaving it alone")
        return None
    if manifest.backend != ACTIVE_BACKEND or manifest.status == "rolled_back":
        return None
    return manifest


def find_job(manifest: Manifest, job_id: str | None) -> JobRecord | None:
    return next((job for job in manifest.jobs if job.job_id == job_id), None)


def run_hook(
    mode: str, run_dir: Path, chain_id: str | None, job_id: str | None, status: int = 0
) -> int:
    """One hook call (``status``: the launcher's, for ``end``); the exit code for the script."""
    if load_chain(run_dir, chain_id) is None:
        return 0
    scrub_job_environment()
    with chain_lock(run_dir):
        manifest = load_chain(run_dir, chain_id)  # again, under the lock
        if manifest is None:
            return 0
        current = find_job(manifest, job_id)
        if current is not None and current.then:
            return 0  # the --then job runs after the chain, whatever became of it
        keeper = ChainKeeper(manifest, current)
        if mode == "end":
            keeper.judge_current(status)
        elif not keeper.has_ended:
            keeper.judge_earlier()
        if mode == "start" and keeper.has_ended:
            say(f"chain {manifest.status} ({manifest.ended}): this job does not train")
            return EXIT_CHAIN_ENDED
    return 0


def main(argv: list[str]) -> int:
    usage = "usage: python -m orchestrator.chain_hooks start | end STATUS | check RUN_DIR"
    mode = argv[0] if argv else ""
    if mode == "end" and len(argv) == 2 and argv[1].isdigit():
        status = int(argv[1])
        run_dir = os.environ.get(job_env.RUN_DIR)
        record = None
        try:
            if run_dir:
                job_id = os.environ.get("SLURM_JOB_ID", "")
                record = read_job_end(run_dir, os.environ.get(job_env.JOB_INDEX, ""), job_id)
                run_hook("end", Path(run_dir), os.environ.get(job_env.CHAIN_ID), job_id, status)
        except Exception as error:  # the outcome line must come whatever failed
            say(f"hook failed: {type(error).__name__}: {error}")
        print(outcome_line(record, status), flush=True)
        return 0
    if mode == "start" and len(argv) == 1:
        run_dir = os.environ.get(job_env.RUN_DIR)
        if not run_dir:
            return 0
        try:
            return run_hook(
                "start",
                Path(run_dir),
                os.environ.get(job_env.CHAIN_ID),
                os.environ.get("SLURM_JOB_ID"),
            )
        except Exception as error:  # never keep a job from training because the hook failed
            say(f"hook failed: {type(error).__name__}: {error}")
            return 0
    if mode == "check" and len(argv) == 2:
        run_hook("check", Path(argv[1]).resolve(), None, None)
        return 0
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
