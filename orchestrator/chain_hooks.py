"""The chain hook: what each job's batch script runs so that a queued chain looks after itself,
with no orchestrator process alive.

    "$ORCH_PYTHON" -m orchestrator.chain_hooks start        first thing in the job
    "$ORCH_PYTHON" -m orchestrator.chain_hooks end STATUS   after the training exited (STATUS)
    python -m orchestrator.chain_hooks check RUN_DIR        by hand, e.g. after the last job died

It reads ORCH_RUN_DIR, ORCH_CHAIN_ID and the job's id (SLURM_JOB_ID, or an array task's
SLURM_ARRAY_JOB_ID and SLURM_ARRAY_TASK_ID; plus SLURM_CONF where SLURM needs it),
and acts on chains of the slurm backend only. Holding the run dir's chain lock, it judges each
ended job of the chain once (its ``outcome`` in the manifest is the idempotency key) from the
trainer's end-of-job record (contract/job_end.py), the launcher's exit status or SLURM's state,
by the rules of orchestrator/chain_judgement.py, and does what they decide: records the
outcome, cancels the chain's queued jobs, queues a replacement, requeues a preempted job.

Before a failure a new process can fix is judged, ``end --restart-in-place`` (what the
rendered batch scripts run) may answer EXIT_RESTART_IN_JOB instead: the script launches the
training again in the same allocation (orchestrator/in_job.py says when), and the job's end is
judged after its last launch.

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
from pathlib import Path

from contract import job_env
from contract.job_end import (
    EXIT_CHAIN_ENDED,
    EXIT_RESTART_IN_JOB,
    RESTART_FLAG,
    job_end_path,
    outcome_line,
    read_job_end,
)
from contract.run_dir import avoid_nodes_path
from contract.seeds import chain_seeds
from contract.slurm_states import END_STATES, ENDING_STATES
from orchestrator import in_job
from orchestrator.arrays import CORRESPONDING, FREED, stuck_tasks, successor_of
from orchestrator.backends import registry
from orchestrator.backends.base import Backend, dependency_spec
from orchestrator.backends.local import LocalBackend
from orchestrator.backends.slurm import SlurmBackend
from orchestrator.chain import THEN_DEPENDENCY, JudgeJob, last_first, replacement_request
from orchestrator.chain_judgement import (
    CHAIN_ENDINGS,
    ENDED,
    REQUEUE,
    REQUEUED,
    Ending,
    chain_settlement,
    chain_stall,
    ended_state,
    judge,
    preemption,
    replacement_slot,
    retries_used,
)
from orchestrator.errors import SchedulerError
from orchestrator.manifest import (
    ENDED_STATUSES,
    MANIFEST_NAME,
    ROLLED_BACK,
    STALLED,
    JobRecord,
    Manifest,
    chain_lock,
)
from orchestrator.slow_nodes import (
    NodeDecision,
    decide,
    exclude_option,
    exclusions_for,
    named_by,
    usable_nodes,
)
from orchestrator.slurm.commands import (
    node_states,
    query_jobs,
    requeue_job,
    show_job,
    update_excluded,
)
from orchestrator.slurm.directives import parse_sbatch_directives
from train.checkpoint.location import newest_step
from train.data.storage import StorageError

ACTIVE_BACKEND = SlurmBackend.label  # the backend whose chains the hook looks after
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
RESTART_COUNT_ENV = "SLURM_RESTART_COUNT"  # set by SLURM in a requeued job: its requeues so far


def say(line: str) -> None:
    print(f"[orch] chain: {line}", flush=True)


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

    def __init__(self, manifest: Manifest, current: JobRecord | None, restarts: int = 0) -> None:
        self.manifest = manifest
        self.current = current
        self.restarts = restarts  # the current job's restart count as this run started
        self.run_dir = Path(manifest.run_dir)
        self.backend = registry.for_run_dir(manifest.backend, self.run_dir)
        self.requeue_id: str | None = None  # a preempted job the hook requeues as its last act

    @property
    def has_ended(self) -> bool:
        return self.manifest.status in ENDED_STATUSES

    def judge_one(
        self, job: JobRecord, status: int | None, state: str, started: bool
    ) -> tuple[JobRecord, Ending]:
        """Judge ``job``, noting the newest checkpoint it left and whether it trained (a record,
        or checkpoints in the run dir: a command that saves none is not measured for stalls)."""
        record = read_job_end(self.run_dir, str(job.index), str(job.job_id))
        if record is not None:
            job.step = record.get("step")
            job.slow = list(record.get("slow") or [])
        try:
            job.checkpoint_step = newest_step(self.run_dir)
        except StorageError as error:  # the bucket did not answer: the job's own word for it
            print(f"warning: {error}; taking job {job.index}'s last step", file=sys.stderr)
            job.checkpoint_step = job.step if record is not None and record.get("saved") else None
        job.measured = record is not None or job.checkpoint_step is not None
        retry_on_exit = tuple(self.manifest.retry_on_exit)
        return job, judge(record, status, state, started, retry_on_exit)

    def judge_current(self, status: int, can_restart: bool = False) -> bool:
        """``end``: the current job has ended with the launcher's ``status``. A run SLURM
        preempted is requeued (same id, it resumes) when the job allows it, by SLURM or else by
        the hook as the job's last act (``requeue_id``), and is not judged; one that may not be
        requeued is a failure to retry, even after it saved. With ``can_restart`` (the batch
        script relaunches on EXIT_RESTART_IN_JOB), a failure a new process fixes is restarted
        in place instead of judged, while orchestrator/in_job.py allows: True."""
        job = self.current
        if job is None or job.outcome is not None:
            return False
        fields = self.slurm_fields(job)
        state = ended_state(fields)
        job, ending = self.judge_one(job, status, state, True)
        preempted = preemption(fields, self.restarts) if ending.outcome != "finished" else None
        restartable = can_restart and preempted is None
        leaving = self.leaving(job) if restartable else None
        if leaving is not None and self.swap_in_spare(job, leaving, state):
            return True
        if restartable and ending.retry and self.restart_in_place(job, ending.detail, state):
            return True
        if preempted in (REQUEUED, REQUEUE):
            say(
                f"job {job.index} (id {job.job_id}) was preempted: {ending.detail}; it is "
                "requeued and comes back with the same id, resuming from the newest checkpoint"
            )
            if preempted == REQUEUE:
                self.requeue_id = str(job.job_id)
            return False
        if preempted == ENDED:
            ending = Ending("failed", f"preempted ({ending.detail})", retry=True)
        self.act([(job, ending)], ended_ids=set())
        if status != 0 or state not in ("", "COMPLETED") or preempted == ENDED:
            self.release_successors(job)
        return False

    def leaving(self, job: JobRecord) -> str | None:
        """The node the job's training stopped to leave for a spare node of its allocation."""
        record = read_job_end(self.run_dir, str(job.index), str(job.job_id))
        return str(record["leave_node"]) if record and record.get("leave_node") else None

    def swap_in_spare(self, job: JobRecord, node: str, state: str) -> bool:
        """The training saved and stopped to leave slow ``node`` for a spare node of the job's
        allocation: the chain's later jobs stay off it too, and the training is launched again
        in place off it (the batch script reads the avoid file) while orchestrator/in_job.py
        allows; else the chain's next job resumes from that save."""
        self.leave_out_slow_nodes([job])
        avoid = avoid_nodes_path(self.run_dir, str(job.job_id))
        avoided = avoid.read_text().split() if avoid.is_file() else []
        avoid.parent.mkdir(exist_ok=True)
        avoid.write_text("".join(f"{name}\n" for name in [*avoided, node]))  # read after we exit
        return self.restart_in_place(job, f"stopped to leave slow node {node}", state)

    def restart_in_place(self, job: JobRecord, detail: str, state: str) -> bool:
        """Count an in-job restart of ``job`` (it ended as ``detail`` says) and put its end
        record aside (the relaunched training writes its own), or say why there is none
        (orchestrator/in_job.py)."""
        where = f"step {job.step}" if job.step is not None else f"checkpoint {job.checkpoint_step}"
        failure = f"{detail} ({where})"
        why_not = in_job.refusal(
            cluster_state=state,
            used=job.in_job_restarts,
            allowed=self.manifest.restarts_in_job,
            failure=failure,
            restarted_for=job.restarted_for,
            seconds_left=in_job.seconds_left(),
            needed_s=in_job.checkpoint_interval_s(self.run_dir),
        )
        if why_not is not None:
            if self.manifest.restarts_in_job:
                say(f"job {job.index} (id {job.job_id}) is not restarted in place: {why_not}")
            return False
        job.in_job_restarts += 1
        job.restarted_for = failure
        record = job_end_path(self.run_dir, str(job.index), str(job.job_id))
        if record.is_file():
            aside = f"{record.stem}.restart{job.in_job_restarts - 1}{record.suffix}"
            record.rename(record.with_name(aside))
        self.manifest.save()
        resume = job.checkpoint_step if job.checkpoint_step is not None else "none: from scratch"
        say(
            f"job {job.index} (id {job.job_id}) {detail}: restarting the training in "
            f"place ({job.in_job_restarts} of {self.manifest.restarts_in_job}), from the newest "
            f"checkpoint (step {resume})"
        )
        return True

    def slurm_fields(self, job: JobRecord) -> dict[str, str]:
        """What SLURM says of the job the hook runs in (``scontrol show job``); empty when it
        does not answer (the trainer's record and the launcher's status judge it alone)."""
        try:
            return show_job(str(job.job_id))
        except SchedulerError as error:
            say(f"could not ask SLURM how job {job.job_id} ends: {error}")
            return {}

    def note_requeue(self, restarts: int) -> None:
        """``start`` of a requeued job: count the restart, and put the record of its run
        before aside (``end`` reads this run's own)."""
        job = self.current
        assert job is not None
        job.restarts = restarts
        record = job_end_path(self.run_dir, str(job.index), str(job.job_id))
        if record.is_file():
            record.rename(record.with_name(f"{record.stem}.run{restarts - 1}{record.suffix}"))
        self.manifest.save()
        say(
            f"job {job.index} (id {job.job_id}) was requeued (restart {restarts}): it resumes "
            "from the newest checkpoint"
        )

    def queue_due_replacements(self) -> None:
        """``start``/``check``: queue the replacements an earlier hook could not (SLURM's
        controller was down past the patience), after the chain's last job."""
        due = [job for job in self.manifest.jobs if job.replacement_due]
        if not due or self.has_ended:
            return
        tail = max((o for o in self.manifest.jobs if not o.then), key=lambda o: o.index)
        state = self.backend.statuses([str(tail.job_id)])[str(tail.job_id)].state
        ended_ids = {str(tail.job_id)} if state in ENDED_STATES else set()
        for job in due:
            self.replace(job, Ending("failed", str(job.replacement_due), retry=True), ended_ids)
            self.manifest.save()

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
            started = any(self.run_dir.glob(self.backend.log_glob(str(job.job_id))))
            endings.append(self.judge_one(job, None, state, started))
        self.act(endings, ended_ids={str(job.job_id) for job, _ in endings})
        for job, _ in endings:
            if statuses[str(job.job_id)].state != "COMPLETED":
                self.release_successors(job)

    def act(self, endings: list[tuple[JobRecord, Ending]], ended_ids: set[str]) -> None:
        """Record the outcomes (saved before anything is queued or cancelled, so no failure is
        ever replaced twice), then end the chain or queue replacements."""
        if not endings:
            return
        for job, ending in endings:
            job.outcome, job.why = ending.outcome, ending.line
            say(f"job {job.index} (id {job.job_id}) {ending.line}")
        self.manifest.save()
        self.leave_out_slow_nodes([job for job, _ in endings])
        for job, ending in endings:
            if job.then or self.has_ended:
                continue
            if ending.outcome in CHAIN_ENDINGS:
                self.end_chain(job, CHAIN_ENDINGS[ending.outcome], ending.line)
            elif ending.retry:
                self.stop_if_stalled()  # a stalled chain spends no more retries
                if not self.has_ended:
                    self.replace(job, ending, ended_ids)
        if not self.has_ended:
            self.stop_if_stalled()
        if not self.has_ended:
            self.settle()
        self.manifest.save()

    def leave_out_slow_nodes(self, judged: list[JobRecord]) -> None:
        """Decide on each node the ``judged`` jobs' trainers named slow (orchestrator/
        slow_nodes.py), record it, and keep the chain's queued jobs off those left out."""
        named = [(job, entry) for job in judged for entry in job.slow if entry.get("node")]
        if not named or not isinstance(self.backend, SlurmBackend):
            return
        decided = self.manifest.slow_nodes
        room: tuple[str, int, set[str]] | str | None = None  # asked of SLURM once, if needed
        for job, entry in named:
            node = str(entry["node"])
            seen = any(d.node == node and d.job == job.index for d in decided)
            if seen or node in exclusions_for(decided, job.index + 1):
                continue
            room = self.partition_room(job) if room is None else room
            decision = self.decide_on(node, named_by(entry, job.index, str(job.job_id)), job, room)
            decided.append(decision)
            say(decision.line())
        self.manifest.save()
        self.keep_off_slow_nodes()

    def decide_on(
        self, node: str, why: str, job: JobRecord, room: tuple[str, int, set[str]] | str
    ) -> NodeDecision:
        """Whether ``node``, named slow by ``job``, leaves the chain: the cap, and enough usable
        nodes left in the partition (``room``: ``partition_room``'s answer)."""
        if isinstance(room, str):
            return NodeDecision(node=node, why=why, job=job.index, kept=room)
        partition, needed, usable = room
        return decide(
            node,
            why=why,
            job=job.index,
            decided=self.manifest.slow_nodes,
            cap=self.manifest.exclude_slow_nodes,
            readmit_after=self.manifest.readmit_slow_nodes,
            usable=usable,
            needed=needed,
            partition=partition,
        )

    def partition_room(self, job: JobRecord) -> tuple[str, int, set[str]] | str:
        """The partition the chain's jobs run in, the nodes each needs, and the partition's
        usable nodes; or why SLURM did not say."""
        queued = [o for o in self.manifest.jobs if o.outcome is None and not o.then and o.job_id]
        try:
            fields = {}
            for candidate in [job, *queued]:
                if fields := show_job(str(candidate.job_id)):
                    break
            if not fields:
                return "SLURM no longer knows the chain's jobs, to size their partition"
            partition = fields.get("Partition", "")
            needed = int(fields.get("NumNodes", "1").split("-")[0] or 1)
            return partition, needed, usable_nodes(node_states(partition))
        except (SchedulerError, ValueError) as error:
            return f"could not size the partition ({str(error).splitlines()[0]})"

    def keep_off_slow_nodes(self) -> None:
        """Set each queued job's --exclude to the recipe's own and the slow nodes it avoids."""
        decided, own = self.manifest.slow_nodes, self.recipe_exclude()
        changed = False
        for other in self.manifest.jobs:
            if other.outcome is not None or other.then or other is self.current:
                continue
            nodes = exclusions_for(decided, other.index)
            if not other.job_id or nodes == other.avoids:
                continue
            try:
                update_excluded(str(other.job_id), exclude_option(own, nodes))
            except SchedulerError as error:
                say(
                    f"could not keep job {other.index} (id {other.job_id}) off "
                    f"{', '.join(nodes) or 'no node'}: {str(error).splitlines()[0]}"
                )
                continue
            other.avoids, changed = nodes, True
            shown = ", ".join(nodes) if nodes else "no slow node"
            say(f"job {other.index} (id {other.job_id}) stays off {shown}")
        if changed:
            self.manifest.save()

    def recipe_exclude(self) -> str:
        """The recipe's own ``#SBATCH --exclude``, kept in every exclusion the chain sets."""
        try:
            text = Path(self.manifest.script).read_text()
        except OSError:
            return ""
        return parse_sbatch_directives(text).get("exclude", "")

    def stop_if_stalled(self) -> None:
        """End the chain once --max-stalled jobs in a row made no progress."""
        stall = chain_stall(self.manifest)
        if stall is not None:
            job, detail = stall
            self.end_chain(job, STALLED, detail)

    def settle(self) -> None:
        """When every job of the chain has ended and nothing more is queued, its status says
        how (chain_judgement.chain_settlement)."""
        settlement = chain_settlement(self.manifest)
        if settlement is None:
            return
        self.manifest.status, self.manifest.ended = settlement
        say(f"chain {self.manifest.status}: {self.manifest.ended}")

    def end_chain(self, job: JobRecord, status: str, detail: str) -> None:
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
        for other in pending:
            self.release_successors(other)
        self.manifest.status = status
        cancelled = f"; cancelled {len(ids)} queued job(s): {' '.join(ids)}" if ids else ""
        self.manifest.ended = f"job {job.index} (id {job.job_id}): {detail}{cancelled}"
        say(f"chain {status}: {self.manifest.ended}")

    def release_successors(self, job: JobRecord) -> None:
        """``job``, an array task (orchestrator/arrays.py), ended unclean: the member's task
        waiting on it task by task (aftercorr) would never start. It waits for its end instead,
        however it ended, as every job of a chain of its own does (afterany), but for an
        ``afterok`` chain's next job: that one stays unstarted, as afterok leaves it."""
        for other in self.manifest.jobs:
            if other.outcome is None and successor_of(other, str(job.job_id)):
                self.free(other, str(job.job_id))

    def free(self, waiting: JobRecord, ended_id: str) -> None:
        """``waiting`` starts once ``ended_id`` has ended, however (afterok's next job stays)."""
        if self.manifest.dependency_kind == "afterok" and not waiting.then:
            return
        spec = f"{FREED}:{ended_id}"
        try:
            self.backend.set_dependency(str(waiting.job_id), spec)
        except SchedulerError as error:
            say(
                f"could not let job {waiting.index} (id {waiting.job_id}) start after job "
                f"{ended_id} ({str(error).splitlines()[0]}); the next task of the sweep to "
                "start frees it"
            )
            return
        waiting.dependency = spec
        self.manifest.save()
        say(f"job {waiting.index} (id {waiting.job_id}) now starts once job {ended_id} has ended")

    def free_stuck(self, stuck_ids: list[str]) -> None:
        """``heal``: tasks SLURM says can never start: each waits on its predecessor's end."""
        for job_id in stuck_ids:
            waiting = find_job(self.manifest, job_id)
            if waiting is None or waiting.outcome is not None or waiting.dependency is None:
                continue
            kind, _, array = waiting.dependency.partition(":")
            if kind == CORRESPONDING:
                self.free(waiting, f"{array}_{job_id.partition('_')[2]}")

    def replace(self, job: JobRecord, ending: Ending, ended_ids: set[str]) -> None:
        """Queue one replacement at the end of the chain, while retries remain."""
        used, allowed = retries_used(self.manifest), self.manifest.retries
        if used >= allowed:
            if allowed:
                say(f"job {job.index} is not replaced: {used} of {allowed} retries used")
            return
        index, after = replacement_slot(self.manifest, ended_ids)
        seed = replacement_seed(self.manifest, index)
        avoids = exclusions_for(self.manifest.slow_nodes, index)
        exclude = exclude_option(self.recipe_exclude(), avoids) if avoids else ""
        request = replacement_request(self.manifest, index, seed, after, exclude)
        try:
            job_id = self.backend.submit(request)
        except SchedulerError as error:
            job.replacement_due = ending.detail
            say(
                f"could not queue the replacement of job {job.index} ({error}); the chain's next "
                "hook run queues it: a later job's start, or by hand `python -m "
                f"orchestrator.chain_hooks check {self.run_dir}`"
            )
            return
        job.replacement_due = None
        self.manifest.jobs.append(
            JobRecord(
                index=index,
                seed=seed,
                job_id=job_id,
                dependency=dependency_spec(request.dependency_kind, after),
                submit_time=time.time(),
                replaces=job.index,
                reason=ending.detail,
                avoids=avoids,
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


def judge_for(backend: Backend) -> JudgeJob | None:
    """What ``submit_chain`` calls after each job of ``backend``: the local backend's chains are
    judged as they run; the hook judges SLURM's (submitit's have no judgement)."""
    return judge_local_job if isinstance(backend, LocalBackend) else None


def judge_local_job(manifest: Manifest, job: JobRecord, backend: Backend) -> None:
    """The local backend has just run ``job`` to its end (auto_launch holds the chain lock):
    judge it as the end hook judges a SLURM job. A replacement (--retries) runs at once, inside
    this judgement, and is judged in turn. No restart in place: the local backend runs the
    training once per job."""
    while True:
        status = backend.statuses([str(job.job_id)])[str(job.job_id)]
        keeper = ChainKeeper(manifest, job)
        submitted = len(manifest.jobs)
        started = any(keeper.run_dir.glob(backend.log_glob(str(job.job_id))))  # afterok: not run
        _, ending = keeper.judge_one(job, status.exit_code, status.state, started)
        keeper.act([(job, ending)], ended_ids={str(job.job_id)})
        if len(manifest.jobs) == submitted:
            return
        job = manifest.jobs[-1]


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
    has that chain's), of the slurm backend; a rolled-back one only to keep its jobs from
    training."""
    path = run_dir / MANIFEST_NAME
    if not path.is_file():
        say(f"no manifest in {run_dir}: nothing to look after")
        return None
    manifest = Manifest.load(path)
    if chain_id is not None and manifest.chain_id != chain_id:
        say(f"{run_dir} now belongs to chain {manifest.chain_id}: leaving it alone")
        return None
    if manifest.backend != ACTIVE_BACKEND:
        return None
    return manifest


def find_job(manifest: Manifest, job_id: str | None) -> JobRecord | None:
    return next((job for job in manifest.jobs if job.job_id == job_id), None)


def run_hook(
    mode: str,
    run_dir: Path,
    chain_id: str | None,
    job_id: str | None,
    status: int = 0,
    can_restart: bool = False,
    stuck_ids: tuple[str, ...] = (),
) -> tuple[int, str | None]:
    """One hook call (``status``: the launcher's, for ``end``; ``can_restart``: the script
    relaunches the training on EXIT_RESTART_IN_JOB; ``heal``: ``check`` of another member of
    the sweep, then ``stuck_ids``, its tasks that can never start, freed): the exit code for
    the script, and the id of a preempted job to requeue once the hook has said all it says."""
    if load_chain(run_dir, chain_id) is None:
        return 0, None
    restarts = int(os.environ.get(RESTART_COUNT_ENV) or 0)  # before the scrub drops it
    scrub_job_environment()
    with chain_lock(run_dir):
        manifest = load_chain(run_dir, chain_id)  # again, under the lock
        if manifest is None:
            return 0, None
        if manifest.status == ROLLED_BACK:
            if mode != "start":
                return 0, None
            say(
                f"chain {manifest.chain_id} was rolled back as it was submitted "
                f"({manifest.error}): this job, which its cancel did not reach, does not train"
            )
            return EXIT_CHAIN_ENDED, None
        current = find_job(manifest, job_id)
        if current is not None and current.then:
            return 0, None  # the --then job runs after the chain, whatever became of it
        keeper = ChainKeeper(manifest, current, restarts)
        if mode == "start" and current is not None and restarts > current.restarts:
            keeper.note_requeue(restarts)
        if mode == "end":
            if keeper.judge_current(status, can_restart):
                return EXIT_RESTART_IN_JOB, None
        elif not keeper.has_ended:
            keeper.queue_due_replacements()
            keeper.judge_earlier()
        if mode == "heal":
            keeper.free_stuck(list(stuck_ids))
        if mode == "start" and keeper.has_ended:
            say(f"chain {manifest.status} ({manifest.ended}): this job does not train")
            return EXIT_CHAIN_ENDED, None
    return 0, keeper.requeue_id


def heal_sweep(own_run_dir: Path) -> None:
    """``start`` of a task of a sweep's arrays: free the members whose next task can never
    start, their predecessor having died without its hook (orchestrator/arrays.py): one
    squeue for the whole sweep. Never keeps this job from training."""
    directory = os.environ.get(job_env.SWEEP_TASKS)
    if not directory:
        return
    try:
        stuck = stuck_tasks(Path(directory), query_jobs)
    except SchedulerError as error:
        say(f"could not look for stuck members of the sweep: {str(error).splitlines()[0]}")
        return
    for run_dir, job_ids in stuck.items():
        if run_dir != own_run_dir.resolve():
            run_hook("heal", run_dir, None, None, stuck_ids=tuple(job_ids))


def requeue(job_id: str) -> None:
    """Put a preempted running job back in the queue: SLURM ends this run (the hook's process
    with it), so it is the hook's very last act."""
    try:
        requeue_job(job_id)
    except SchedulerError as error:
        say(f"could not requeue job {job_id} ({error}): the chain's next job resumes instead")


def main(argv: list[str]) -> int:
    usage = (
        "usage: python -m orchestrator.chain_hooks start | end STATUS [--restart-in-place] | "
        "check RUN_DIR"
    )
    mode = argv[0] if argv else ""
    restartable = argv[2:] in ([], [RESTART_FLAG])
    if mode == "end" and 2 <= len(argv) <= 3 and argv[1].isdigit() and restartable:
        status = int(argv[1])
        run_dir = os.environ.get(job_env.RUN_DIR)
        record = requeue_id = None
        try:
            if run_dir:
                job_id = job_env.job_id(os.environ) or ""
                record = read_job_end(run_dir, os.environ.get(job_env.JOB_INDEX, ""), job_id)
                chain_id = os.environ.get(job_env.CHAIN_ID)
                can_restart = argv[2:] == [RESTART_FLAG]
                code, requeue_id = run_hook(
                    "end", Path(run_dir), chain_id, job_id, status, can_restart
                )
                if code == EXIT_RESTART_IN_JOB:
                    return code  # no outcome line: the job goes on
        except Exception as error:  # the outcome line must come whatever failed
            say(f"hook failed: {type(error).__name__}: {error}")
        print(outcome_line(record, status), flush=True)
        if requeue_id is not None:
            requeue(requeue_id)
        return 0
    if mode == "start" and len(argv) == 1:
        run_dir = os.environ.get(job_env.RUN_DIR)
        if not run_dir:
            return 0
        try:
            code, _ = run_hook(
                "start",
                Path(run_dir),
                os.environ.get(job_env.CHAIN_ID),
                job_env.job_id(os.environ),
            )
            heal_sweep(Path(run_dir))
            return code
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
