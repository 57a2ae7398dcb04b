"""SLURM's job states, in one place: which mean the job has ended.

Every backend reports states in SLURM's vocabulary. ``logs --follow`` stops, ``cancel`` skips
and the chain hook judges a job by these lists. A requeued job (preempted under
``PreemptMode=REQUEUE``, or ``scontrol requeue``) goes back to PENDING with the same id, so it is
live again; PREEMPTED is what stays when it is not requeued.
"""

from __future__ import annotations

END_STATES = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
)
# The cluster ended the job, not its own work: a new job can do what it could not.
CUT_SHORT_STATES = ("NODE_FAIL", "PREEMPTED", "BOOT_FAIL")
# What SLURM's Reason says of a job it is ending (COMPLETING) for one of these: the end state it
# will record. A node lost under a multi-node step shows COMPLETING with Reason=NodeDown while
# the batch shell, on a surviving node, runs its end hook; NODE_FAIL shows only afterwards.
ENDING_REASONS = {"NodeDown": "NODE_FAIL", "TimeLimit": "TIMEOUT"}
# Ending: the job's processes are being cleaned up. Its dependants may already start (the chain
# hook counts it as ended), but its log may still grow (``logs --follow`` waits).
ENDING_STATES = ("COMPLETING",)
# A job requeued on preemption may show PREEMPTED before it is PENDING again: wait this long
# before taking PREEMPTED as its end.
REQUEUE_GRACE_S = 5.0


def has_ended(state: str) -> bool:
    """Whether a job in ``state`` has ended: nothing of it runs or will run again."""
    return state in END_STATES
