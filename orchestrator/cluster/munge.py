"""munged, which every SLURM daemon needs to authenticate: one for the whole machine, started
by the first cluster that finds none running."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from orchestrator.cluster.daemons import MARKER_ENV, pid_from_file
from orchestrator.cluster.record import COMMAND_TIMEOUT_S
from orchestrator.errors import SchedulerError
from orchestrator.processes import environment, live_processes

MUNGE_RUN_DIR = Path("/run/munge")
MUNGE_PID_FILE = MUNGE_RUN_DIR / "munged.pid"


def munged_pids() -> list[int]:
    return [process.pid for process in live_processes() if process.name() == "munged"]


def ensure_munged(munged: str) -> tuple[bool, int | None]:
    """Start munged (as the munge user, like its systemd unit) unless one runs already.

    Returns whether this call started it, and its pid.
    """
    running = munged_pids()
    if running:
        return False, running[0]
    MUNGE_RUN_DIR.mkdir(mode=0o755, exist_ok=True)
    shutil.chown(MUNGE_RUN_DIR, user="munge", group="munge")
    completed = subprocess.run(
        ["runuser", "-u", "munge", "--", munged],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    if completed.returncode != 0:
        running = munged_pids()
        if running:  # another `up` started it at the same moment
            return False, running[0]
        raise SchedulerError(f"munged failed to start: {completed.stderr.strip()}")
    return True, pid_from_file(MUNGE_PID_FILE)


def slurm_daemons_elsewhere(directory: Path) -> bool:
    """Whether slurm daemons that are not this cluster's run on the machine (they need munge)."""
    marker = str(directory)
    return any(
        process.name() in ("slurmctld", "slurmd", "slurmstepd", "slurmdbd")
        and environment(process).get(MARKER_ENV) != marker
        for process in live_processes()
    )
