"""What a chain's run dir says about a job that SLURM cannot tell about.

Asked when the controller is unreachable, or when a finished job has left SLURM's memory on a
cluster without accounting. The templates end every job's log with ``[orch] training exited
with status N``, or ``[orch] training stopped on SIGNAL after saving step N (... exit status
S ...)`` for a clean stop on a signal (contract/job_end.py writes and reads both): that line is
the job's outcome. A log without it says only that the job started (the metrics, how far it got);
no log, that it has not started.
"""

from __future__ import annotations

from pathlib import Path

from contract.job_end import read_outcome
from orchestrator.backends.base import JobStatus
from orchestrator.results import iter_metrics

SOURCE = "run dir"
STARTED = "STARTED"  # a log, but no end recorded: running, or ended unrecorded
NOT_STARTED = "NOT_STARTED"  # no log: pending, or cancelled before it ran


def run_dir_status(run_dir: Path | None, job_id: str, log_glob: str, why: str) -> JobStatus:
    """The job's state as its log and metrics show it; ``why`` says why SLURM was not asked."""
    logs = sorted(Path(run_dir).glob(log_glob)) if run_dir is not None else []
    if run_dir is None:
        return JobStatus(job_id, "UNKNOWN", reason=f"{why}; no run dir to look in", source=SOURCE)
    if not logs:
        return JobStatus(job_id, NOT_STARTED, reason=f"{why}; no log yet", source=SOURCE)
    outcome = read_outcome(logs[0].read_text(errors="replace"))
    if outcome is not None and outcome[0] is not None:
        signal, code = outcome
        reason = f"{why}; from its log: stopped on {signal} after saving"
        # Exit 0: the warning signal before the time limit; else scancel or the limit itself.
        state = "COMPLETED" if code == 0 else "CANCELLED"
        return JobStatus(job_id, state, exit_code=code, reason=reason, source=SOURCE)
    if outcome is not None:
        code = outcome[1]
        state = "COMPLETED" if code == 0 else "FAILED"
        return JobStatus(
            job_id, state, exit_code=code, reason=f"{why}; from its log", source=SOURCE
        )
    steps = [
        row["step"]
        for row in iter_metrics(Path(run_dir))
        if str(row.get("slurm_job_id")) == job_id and "step" in row
    ]
    got = f", metrics up to step {steps[-1]}" if steps else ""
    return JobStatus(job_id, STARTED, reason=f"{why}; its log has no end{got}", source=SOURCE)
