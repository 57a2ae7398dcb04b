"""The chain's judgement: what a job's end means for its chain, and what the chain does next.

Pure functions of what they are handed (the trainer's end-of-job record, the launcher's exit
status, SLURM's state and fields, the manifest): they read and change nothing, so each rule is
tested without a cluster. The chain hook (orchestrator/chain_hooks.py) gathers their inputs and
does what they decide. A job's ending, from its record, else the launcher's status, else
SLURM's state:

- finished (max_steps): the chain is complete; its queued jobs are cancelled while pending;
- diverged: the chain stops the same way, its reason in the manifest; no retry is spent;
- blocked (the trainer's exit 2, config refused, or 4, checkpoints cannot be saved): a new job
  would fail the same way, so the chain stops the same way too; no retry is spent;
- stopped (a signal or a budget, after saving) or completed (exit 0, no record): nothing to do;
- failed: a failure a new job can fix queues one replacement at the end of the chain while
  ``--retries`` allow: the cluster cut the job short (NODE_FAIL, PREEMPTED: even after it saved,
  the chain lost a job's worth of time; ``end`` asks SLURM, which has decided before it signals
  the job), its time limit came before a save, a rank hung (exit 5)
  or lost a peer (exit 6), a process was killed by a signal (status over 128, or the batch
  shell killed before its end hook), or an exit code the user listed (``--retry-on-exit``).
  Any other failure (an error of the training's own, exit 1) is not retried: a new job would
  fail alike.

After the outcomes, two checks end the chain: ``--max-stalled N`` jobs in a row that ended
without a newer complete checkpoint than the chain had before them stop it as ``stalled`` (its
queued jobs cancelled: they would burn the queue); and when its last job has ended with the
training unfinished and nothing more is queued, the chain is ``incomplete``, its line naming the
step reached and the command that continues it.
"""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass
from typing import Any

from contract.job_end import EXIT_CONFIG, EXIT_HUNG, EXIT_NOT_SAVED, EXIT_PEER_LOST
from contract.slurm_states import CUT_SHORT_STATES, END_STATES, ENDING_REASONS, ENDING_STATES
from orchestrator.chain_status import run_order, signal_name
from orchestrator.manifest import (
    BLOCKED,
    CANCELLED,
    COMPLETE,
    DIVERGED,
    FAILED,
    INCOMPLETE,
    JobRecord,
    Manifest,
)

# Trainer exits a new job would only repeat: no replacement is queued for them.
BLOCKING_EXITS = {
    EXIT_CONFIG: "the trainer's config or layout is refused",
    EXIT_NOT_SAVED: "checkpoints cannot be saved (the run dir's disk is full or read-only)",
}
# Trainer exits a new job can fix: retried under --retries.
TRANSIENT = {
    EXIT_HUNG: "a rank hung",
    EXIT_PEER_LOST: "a rank lost a peer",
}
# The shell's own statuses for a command it could not start: a new job would only repeat them.
SHELL_FAILURES = {
    126: "the shell found a command it cannot execute (check its permissions)",
    127: "the shell found no such command: the job's PATH lacks the launcher or the program "
    "(activate the toolkit's environment before auto_launch)",
}
# Outcomes that end the whole chain (its queued jobs are cancelled), and the status each gives it.
CHAIN_ENDINGS = {"finished": COMPLETE, "diverged": DIVERGED, "blocked": BLOCKED}
REQUEUED, REQUEUE, ENDED = "requeued", "requeue", "ended"  # what became of a preempted run


@dataclass(frozen=True)
class Ending:
    """What a job's end means for the chain: an outcome word, one line saying why, and whether
    a failure is one a new job can fix (a replacement is queued under --retries)."""

    outcome: str  # finished, stopped, completed, failed, blocked, diverged, not_started
    detail: str
    retry: bool = False
    said: str | None = None  # the trainer's error line, from its end-of-job record

    @property
    def line(self) -> str:
        """What the chain's lines and status say: the detail, then the trainer's own error."""
        return f"{self.detail}; error: {self.said}" if self.said else self.detail


def judge(
    record: dict[str, Any] | None,
    status: int | None,
    state: str,
    started: bool,
    retry_on_exit: tuple[int, ...] = (),
) -> Ending:
    """The ending of one job: ``record`` is its end-of-job record, ``status`` the launcher's exit
    status (known to ``end`` only), ``state`` SLURM's, ``started`` whether it has a log, and
    ``retry_on_exit`` the exit codes the user listed as worth a retry."""
    step = record.get("step") if record is not None else None
    if record is not None and record.get("finished"):
        return Ending("finished", f"training finished at step {step}")
    if record is not None and record["reason"] == "diverged":
        return Ending("diverged", f"training diverged at step {step}")
    if state in CUT_SHORT_STATES:
        saved = f" after saving step {step}" if record is not None and record.get("saved") else ""
        return Ending("failed", f"cut short by the cluster ({state}){saved}", retry=True)
    if record is not None and record.get("saved") and record.get("leave_node"):
        node = record["leave_node"]
        return Ending("stopped", f"training stopped after saving step {step} to leave {node}")
    if record is not None and record.get("saved"):
        signalled = record["reason"] == "signal"
        why = record.get("signal") or ("a signal" if signalled else "its budget")
        return Ending("stopped", f"training stopped on {why} after saving step {step}")
    if state == "TIMEOUT":
        return Ending("failed", "reached its time limit before saving", retry=True)
    if record is not None:
        code, said = record.get("exit_code"), record.get("error")
        if code in BLOCKING_EXITS:
            why = f"{BLOCKING_EXITS[code]} (exit {code}); no retry: fix it and queue again"
            return Ending("blocked", why, said=said)
        ending = failure(f"training failed at step {step} (exit {code})", code, retry_on_exit)
        return dataclasses.replace(ending, said=said)
    if status is not None:
        if status == 0:
            return Ending("completed", "exited with status 0")
        said = f"exited with status {status} and no end-of-job record"
        return failure(said, status, retry_on_exit)
    if state == "CANCELLED" and not started:
        return Ending("not_started", "cancelled before it started")
    if state == "COMPLETED":
        return Ending("completed", "completed")
    # The batch shell ended without its end hook: killed (SIGKILL, the OOM killer, a lost node).
    retry = state in ("FAILED", "CANCELLED") and started
    return Ending("failed", f"ended {state} without running its end hook", retry=retry)


def ended_state(fields: dict[str, str]) -> str:
    """The end state SLURM gives the job the hook runs in, or "" while it gives none. SLURM
    decides it before it signals the job's processes: a node lost under a multi-node step
    (NODE_FAIL, shown as COMPLETING with Reason=NodeDown until the job is cleaned up) or the
    time limit is known to the end hook, although the trainer may have saved and exited 0 on
    the signal. PREEMPTED is left to the preemption check, which tells a requeued run from an
    ended one."""
    state = fields.get("JobState", "")
    if state in ENDING_STATES:
        state = ENDING_REASONS.get(fields.get("Reason", ""), "")
    return state if state in END_STATES and state != "PREEMPTED" else ""


def preemption(fields: dict[str, str], restarts: int) -> str | None:
    """Whether SLURM preempted this run of the job (a PreemptTime since the run started), from
    its ``scontrol show job`` fields and the restart count the run started with: None, or
    REQUEUED (SLURM requeued it already), REQUEUE (it may be requeued) or ENDED (it may not)."""
    preempted_at = fields.get("PreemptTime", "None")
    if not preempted_at[:1].isdigit() or preempted_at < fields.get("StartTime", ""):
        return None
    if int(fields.get("Restarts", 0)) > restarts:
        return REQUEUED
    return REQUEUE if fields.get("Requeue") == "1" else ENDED


def failure(said: str, code: Any, retry_on_exit: tuple[int, ...]) -> Ending:
    """A failed job with exit ``code``: retried when a new job can fix it (see the module)."""
    if code in TRANSIENT:
        return Ending("failed", f"{said}: {TRANSIENT[code]}", retry=True)
    if isinstance(code, int) and code > 128:
        name = signal_name(code - 128)
        return Ending("failed", f"{said}: killed by {name}", retry=True)
    if code in retry_on_exit:
        return Ending("failed", f"{said}, listed in --retry-on-exit", retry=True)
    if code in SHELL_FAILURES:
        why = f"{SHELL_FAILURES[code]}; not retried: a new job would fail alike"
        return Ending("failed", f"{said}: {why}")
    return Ending(
        "failed",
        f"{said}; not retried: a new job would fail alike (--retry-on-exit {code} retries it)",
    )


def stalled_jobs(manifest: Manifest) -> list[JobRecord]:
    """The chain's latest jobs, in a row, that ended without a newer complete checkpoint than
    the chain had before each (jobs whose progress was not measured are passed over)."""
    best = manifest.start_step
    stalled: list[JobRecord] = []
    for job in sorted(manifest.jobs, key=lambda job: job.index):
        if job.then or job.outcome in (None, "not_started") or not job.measured:
            continue
        if job.checkpoint_step is not None and (best is None or job.checkpoint_step > best):
            best = job.checkpoint_step
            stalled = []
        else:
            stalled.append(job)
    return stalled


def chain_stall(manifest: Manifest) -> tuple[JobRecord, str] | None:
    """Once --max-stalled jobs in a row made no progress: the last of them and the line that
    ends the chain as stalled; else None."""
    limit = manifest.max_stalled
    stalled = stalled_jobs(manifest)
    if limit <= 0 or len(stalled) < limit:
        return None
    newest = stalled[-1].checkpoint_step
    at = f"step {newest}" if newest is not None else "no checkpoint"
    return stalled[-1], (
        f"{len(stalled)} jobs in a row ended without a newer checkpoint (still {at}; "
        f"--max-stalled {limit}): look at their logs before queueing more"
    )


def chain_settlement(manifest: Manifest) -> tuple[str, str] | None:
    """The chain's status and its line once every job has ended and nothing more is queued
    (else None): the last job that ran (the latest submitted) failed: FAILED; it stopped after
    saving with the training unfinished: INCOMPLETE (both name the step reached and the command
    that continues); none ran: CANCELLED; else COMPLETE."""
    chain_jobs = [job for job in manifest.jobs if not job.then]
    if any(job.outcome is None or job.replacement_due for job in chain_jobs):
        return None
    if sum(job.replaces is None for job in chain_jobs) < manifest.num_jobs:
        return None  # a local chain's planned jobs still to run
    ran = [job for job in chain_jobs if job.outcome != "not_started"]
    last = max(ran or chain_jobs, key=run_order)
    steps = [job.step for job in chain_jobs if job.step is not None]
    reached = f"step {max(steps)}" if steps else "no recorded step"
    that_ran = " that ran" if ran and len(ran) < len(chain_jobs) else ""
    which = f"job {last.index} (id {last.job_id}), the last{that_ran},"
    more = f"; continue it with: {continue_command(manifest)}"
    if last.outcome == "failed":
        ended = f"{which} {last.why}"
        if last.measured:
            ended += f" (training at {reached}){more}"
        return FAILED, ended
    if last.outcome == "stopped" and last.measured:
        return INCOMPLETE, f"{which} ended with training unfinished at {reached}{more}"
    if last.outcome == "not_started":
        return CANCELLED, f"{which} was cancelled before it started"
    return COMPLETE, f"every job ended; {which} {last.why or last.outcome}"


def continue_command(manifest: Manifest) -> str:
    """The auto_launch command line that queues one more job of the chain's recipe in its run
    dir (run from the directory the chain was launched from)."""
    words = ["auto_launch", "-n1", "--run-dir", manifest.run_dir, manifest.recipe]
    if manifest.args:
        words += ["--", *manifest.args]
    return shlex.join(words)


def retries_used(manifest: Manifest) -> int:
    """The replacements the chain has queued, each spending one of its --retries."""
    return sum(job.replaces is not None for job in manifest.jobs)


def replacement_slot(manifest: Manifest, ended_ids: set[str]) -> tuple[int, str | None]:
    """Where a replacement goes: its index, after every planned job (the --then job's included)
    and every job queued, and the job it waits for: the chain's latest submitted, or none when
    that one is among ``ended_ids``."""
    planned = manifest.num_jobs + (manifest.then is not None)
    index = max(planned, *(job.index + 1 for job in manifest.jobs))
    tail = max((job for job in manifest.jobs if not job.then), key=run_order)
    return index, None if str(tail.job_id) in ended_ids else str(tail.job_id)
