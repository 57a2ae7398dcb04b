"""Restarting the training inside its own allocation: the first rung of recovery.

A rank killed, hung (exit 5) or cut off from its peers (exit 6) ends the training, not the job:
the allocation, its nodes and its place in the queue are still held. When the chain hook judges
such a failure at the job's end, it may answer the batch script with EXIT_RESTART_IN_JOB, and
the script launches the training again (a new srun step, every rank a new process: a hung NCCL
collective dies with its process group, and srun's --kill-on-bad-exit leaves no rank holding a
GPU), which resumes from the newest complete checkpoint. The script relaunches, not torchrun's
own --max-restarts, because only the hook sees what a restart can fix: the chain's judgement of
the exit (a config error or a diverged run must not restart), SLURM's state (a node it has
declared lost cannot be launched on again) and the chain's record of earlier restarts.

A restart is refused, and the chain's replacement logic (``--retries``) takes over, when:
the cluster ended the job (its node lost, its time up, preempted), the job's restarts are spent
(``--restarts-in-job``), the same failure comes back at the same place (a deterministic fault
is not restarted forever), or the job has less time left than a checkpoint interval (a restart
would be cut off before it saved anything).

A training that saved and stopped to leave a slow node for a spare node of its allocation (a
recipe's ``spare_nodes``; orchestrator/slow_nodes.py) is restarted in place by the same rules,
off that node.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from contract import job_env
from train.checkpoint.location import completed

# The time a restart needs when the run dir has too few checkpoints to measure an interval.
MIN_RESTART_S = 60.0


def refusal(
    *,
    cluster_state: str,
    used: int,
    allowed: int,
    failure: str,
    restarted_for: str | None,
    seconds_left: float | None,
    needed_s: float,
) -> str | None:
    """Why a failure a new process can fix is not restarted in place, or None: restart it.
    ``failure`` names the failure and where it happened; ``restarted_for`` is the one the job
    was last restarted for."""
    if cluster_state:
        return f"the cluster ended the job ({cluster_state})"
    if used >= allowed:
        return f"{used} of {allowed} in-job restarts used (--restarts-in-job)"
    if failure == restarted_for:
        return "the same failure came back at the same place after a restart"
    if seconds_left is not None and seconds_left < needed_s:
        return (
            f"{seconds_left:.0f} s left in the job, less than a checkpoint interval "
            f"({needed_s:.0f} s)"
        )
    return None


def checkpoint_interval_s(run_dir: Path) -> float:
    """Seconds between the run dir's two newest complete checkpoints (their markers' times),
    at least MIN_RESTART_S; MIN_RESTART_S when there are fewer than two."""
    steps = completed(run_dir)
    if len(steps) < 2:
        return MIN_RESTART_S
    before, newest = (steps[step][1] for step in sorted(steps)[-2:])
    return max(MIN_RESTART_S, newest - before)


def seconds_left() -> float | None:
    """Seconds until the training must have saved and stopped (the batch script's STOP_AT);
    None when the job's end is unknown."""
    stop_at = os.environ.get(job_env.STOP_AT)
    return float(stop_at) - time.time() if stop_at else None
