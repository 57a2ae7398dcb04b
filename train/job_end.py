"""The end-of-job record: how a job's training ended, for the chain's hook to act on.

Rank 0 writes ``RUN_DIR/job_ends/<ORCH_JOB_INDEX>-<SLURM_JOB_ID>.json`` as the trainer exits
(only inside a job: no ``SLURM_JOB_ID``, no record), atomically, so a reader sees all of it or
nothing:

    {"reason": "max_steps" | "signal" | "budget" | "diverged" | "error",
     "step": N, "finished": bool, "saved": bool, "signal": "SIGTERM" | "SIGUSR1" | null,
     "exit_code": N}

``saved`` means the state at ``step`` is in a complete checkpoint. The batch script's hook
(``orchestrator.chain_hooks``) reads it: finished cancels the chain's queued jobs, diverged stops
the chain, a saved stop is no failure, an error (or no record at all: killed, node lost) is one.
The orchestrator reads this module too, so it must stay free of torch and of the rest of train.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

JOB_ENDS_DIR = "job_ends"
EXIT_DIVERGED = 3  # N consecutive non-finite steps: nothing new saved, the next job resumes
EXIT_NOT_SAVED = 4  # a checkpoint could not be written (disk full, read-only): previous intact
REASONS = ("max_steps", "signal", "budget", "diverged", "error")


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
) -> dict[str, Any]:
    """The record of a trainer that returned ``exit_code`` (0: it saved on its way out)."""
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
    }


def write_job_end(run_dir: Path | str, record: dict[str, Any]) -> Path | None:
    """Write the record of this job (rank 0 only); None outside a SLURM-style job."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    path = job_end_path(run_dir, os.environ.get("ORCH_JOB_INDEX", "0"), job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(record, handle, sort_keys=True)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return path
