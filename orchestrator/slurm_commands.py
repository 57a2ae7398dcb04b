"""Thin subprocess shell around SLURM's command-line tools.

Every call has a timeout, and calls that fail with a transient controller error (the controller
busy or restarting) are retried with backoff before the failure reaches the user.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Sequence

from orchestrator.errors import SchedulerError

TRANSIENT_MARKERS = (
    "Unable to contact slurm controller",
    "Socket timed out",
    "Zero Bytes were transmitted or received",
    "Slurm temporarily unable to accept job",
    "Resource temporarily unavailable",
    "Connection refused",
)
# For sbatch only errors that prove the job was not accepted may be retried; a timeout could mean
# the job was queued and a retry would submit it twice.
SUBMIT_TRANSIENT_MARKERS = (
    "Unable to contact slurm controller",
    "Slurm temporarily unable to accept job",
    "Connection refused",
)
RETRY_DELAYS_S = (0.5, 1.0, 2.0, 4.0)


PARTITION_FORMAT = "%P|%a|%D|%c|%G|%l"


def probe_partitions() -> str | None:
    """sinfo's partition table (PARTITION_FORMAT), or None when no SLURM controller answers.

    One call answers both "is there a SLURM?" and "what can it run?" for the preflight.
    """
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return None
    try:
        completed = subprocess.run(
            ["sinfo", "--noheader", f"--format={PARTITION_FORMAT}"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return completed.stdout if completed.returncode == 0 else None


def slurm_available() -> bool:
    return probe_partitions() is not None


def is_transient(message: str, markers: Sequence[str] = TRANSIENT_MARKERS) -> bool:
    return any(marker in message for marker in markers)


def run_slurm(
    argv: Sequence[str],
    *,
    timeout_s: float = 60,
    retry: bool = True,
    delays: Sequence[float] = RETRY_DELAYS_S,
    transient_markers: Sequence[str] = TRANSIENT_MARKERS,
    env: dict[str, str] | None = None,
) -> str:
    """Run a SLURM command and return its stdout; raise SchedulerError with its own message."""
    attempts = [0.0, *delays] if retry else [0.0]
    message = ""
    for delay in attempts:
        if delay:
            time.sleep(delay)
        try:
            completed = subprocess.run(
                list(argv), capture_output=True, text=True, timeout=timeout_s, env=env
            )
        except FileNotFoundError as error:
            raise SchedulerError(f"{argv[0]} not found: is SLURM installed? ({error})") from error
        except subprocess.TimeoutExpired:
            message = f"{argv[0]} did not answer within {timeout_s:.0f} s"
            if transient_markers is SUBMIT_TRANSIENT_MARKERS:
                break
            continue
        if completed.returncode == 0:
            return completed.stdout
        message = (completed.stderr or completed.stdout).strip() or f"exit {completed.returncode}"
        if not is_transient(message, transient_markers):
            break
    raise SchedulerError(f"{argv[0]} failed: {message}")
