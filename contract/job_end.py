"""How a job's training ended: the trainer's exit codes, its end-of-job record, the log's line.

Rank 0 writes ``RUN_DIR/job_ends/<ORCH_JOB_INDEX>-<job id>.json`` as the trainer exits (the id
the chain records: contract.job_env.job_id; only inside a job: no ``SLURM_JOB_ID``, no record),
atomically, so a reader sees all of it or nothing. A rank that ends the job itself (its hang
watchdog, exit 5; a lost peer rank, exit 6) writes it too where there is none yet: rank 0 may
be the rank that was lost.

    {"reason": "max_steps" | "signal" | "budget" | "diverged" | "error",
     "step": N, "finished": bool, "saved": bool, "signal": "SIGTERM" | "SIGUSR1" | null,
     "exit_code": N, "error": "data: ... does not exist; make the corpus ..." | null,
     "slow": [{"node": "n2", "rank": 1, "ratio": 1.84, "step": 40}],   (only where one was named)
     "leave_node": "n2"}   (only where the training stopped to leave it for a spare node)

``saved`` means the state at ``step`` is in a complete checkpoint. ``slow``: the ranks the trainer
named slow (train/loop/straggler.py), with their nodes. ``error`` is the trainer's own
``error:`` line (its first line, without the prefix) where it stopped on one: what the chain's
status, its ``[local]`` line and ``orchestrator logs`` show instead of the launcher's traceback.
The batch script's hook (``orchestrator.chain_hooks``) reads it: finished cancels the chain's
queued jobs, diverged stops the chain, a saved stop is no failure, an error (or no record at
all: killed, node lost) is one.

The job's log ends with the outcome line (``outcome_line``, printed by the hook, or by the batch
script where no hook runs): ``orchestrator status`` reads it back (``read_outcome``) when SLURM
cannot say how the job ended.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from contract import job_env
from contract.run_dir import JOB_ENDS_DIR

EXIT_CONFIG = 2  # the config or layout is refused before training: a new job would fail alike
EXIT_DIVERGED = 3  # N consecutive non-finite steps: nothing new saved, the next job resumes
EXIT_NOT_SAVED = 4  # a checkpoint could not be written (disk full, read-only): previous intact
EXIT_HUNG = 5  # no progress for train.hang_timeout_s: nothing saved, the next job resumes
EXIT_PEER_LOST = 6  # a collective failed: a peer rank died or its link broke; the next job resumes
EXIT_CHAIN_ENDED = 100  # the chain hook's `start`: the chain has ended, this job does not train
# The chain hook's `end`: the training failed in a way a new process fixes and the job has time
# left, so the batch script launches it again in the same allocation (orchestrator/in_job.py).
EXIT_RESTART_IN_JOB = 101
RESTART_FLAG = "--restart-in-place"  # the batch script's `end` argument: it relaunches on 101
REASONS = ("max_steps", "signal", "budget", "diverged", "error")
ERROR_PREFIX = "error: "  # how the trainer's one-line errors start, in a log
MAX_ERROR_CHARS = 1000  # of the error line a record keeps


def job_end_path(run_dir: Path | str, job_index: str, job_id: str) -> Path:
    return Path(run_dir) / JOB_ENDS_DIR / f"{job_index}-{job_id}.json"


def read_job_end(run_dir: Path | str, job_index: str, job_id: str) -> dict[str, Any] | None:
    """The job's record, or None when it wrote none (or an unreadable one: no better)."""
    try:
        record = json.loads(job_end_path(run_dir, job_index, job_id).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("reason") in REASONS else None


def job_end_record(
    exit_code: int,
    *,
    step: int,
    max_steps: int,
    signalled: bool,
    signal_name: str | None,
    diverged: bool,
    error: str | None = None,
) -> dict[str, Any]:
    """The record of a trainer that returned ``exit_code`` (0: it saved on its way out), and
    said ``error`` (its ``error:`` line) if it stopped on one."""
    finished = exit_code == 0 and step >= max_steps
    if diverged:
        reason = "diverged"
    elif exit_code != 0:
        reason = "error"
    elif finished:
        reason = "max_steps"
    else:
        reason = "signal" if signalled else "budget"
    return {
        "reason": reason,
        "step": step,
        "finished": finished,
        "saved": exit_code == 0,
        "signal": signal_name if reason == "signal" else None,
        "exit_code": exit_code,
        "error": one_line(error) if error else None,
    }


def one_line(error: str) -> str:
    """An error message as the record keeps it: its first line, without ``error:``, bounded."""
    first = (error.strip().splitlines() or [""])[0].removeprefix(ERROR_PREFIX).strip()
    return first if len(first) <= MAX_ERROR_CHARS else first[: MAX_ERROR_CHARS - 3] + "..."


def write_job_end(run_dir: Path | str, record: dict[str, Any], replace: bool = True) -> Path | None:
    """Write the record of this job; None outside a SLURM-style job. ``replace=False`` (a rank
    other than 0) leaves a record already there as it is: rank 0 wrote how the job ended."""
    job_id = job_env.job_id(os.environ)
    if not job_id:
        return None
    path = job_end_path(run_dir, os.environ.get(job_env.JOB_INDEX, "0"), job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(record, handle, sort_keys=True)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        if replace:
            os.replace(tmp_name, path)
        else:
            with contextlib.suppress(FileExistsError):  # a link never replaces: created or not
                os.link(tmp_name, path)
    finally:
        Path(tmp_name).unlink(missing_ok=True)
    return path


EXITED_PREFIX = "[orch] training exited with status"
EXITED_LINE = re.compile(rf"^{re.escape(EXITED_PREFIX)} (\d+)\s*$", re.MULTILINE)
STOPPED_LINE = re.compile(
    r"^\[orch\] training stopped on (.+) after saving step \d+ \((?:launcher )?exit status (\d+)",
    re.MULTILINE,
)


def outcome_line(record: dict[str, Any] | None, status: int) -> str:
    """The job log's last line. A stop on a signal is told as one: the launcher may report a
    status of its own (torchrun turns SIGTERM into 1) when the training saved and stopped."""
    if record is not None and record["reason"] == "signal" and record.get("saved"):
        signal = record.get("signal") or "a signal"
        stopped = f"[orch] training stopped on {signal} after saving step {record.get('step')}"
        if status:
            return f"{stopped} (launcher exit status {status} is its own signal handling)"
        return f"{stopped} (exit status 0)"
    return f"{EXITED_PREFIX} {status}"


def read_outcome(log: str) -> tuple[str | None, int] | None:
    """The last outcome line of a job's log: ``(signal, status)`` for a saved stop on a signal,
    ``(None, status)`` for an exit, None when the log has none (the job has not ended, or ended
    before it could write one)."""
    stops = list(STOPPED_LINE.finditer(log))
    exits = list(EXITED_LINE.finditer(log))
    if stops and (not exits or stops[-1].start() > exits[-1].start()):
        return stops[-1].group(1), int(stops[-1].group(2))
    if exits:
        return None, int(exits[-1].group(1))
    return None
