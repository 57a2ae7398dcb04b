"""What the orchestrator hands a job in its environment, and the numbers derived from it.

auto_launch (through the batch templates, the local and the submitit backends) exports these
variables into every job of a chain; the trainer, the chain hook and the metrics read them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

RUN_DIR = "ORCH_RUN_DIR"  # the chain's run dir: checkpoints, metrics, logs
CHAIN_ID = "ORCH_CHAIN_ID"
JOB_INDEX = "ORCH_JOB_INDEX"  # 0-based index of the job in its chain
NUM_JOBS = "ORCH_NUM_JOBS"
SEED = "ORCH_SEED"  # the job's own seed
SWEEP_ID = "ORCH_SWEEP_ID"  # set for the members of a sweep
PYTHON = "ORCH_PYTHON"  # the interpreter that runs the chain hook
HOME = "ORCH_HOME"  # where chains, indexes and the default cluster dir live
# The code a chain's jobs run: the snapshot of the git work tree frozen at submission, or the
# directory given with --code DIR (unset with --code live).
CODE_DIR = "ORCH_CODE_DIR"
# Epoch seconds at which the training saves and stops by itself: the batch script sets it to the
# job's end time (squeue's) less ``signal_grace``, a second path beside SLURM's USR1 warning.
STOP_AT = "ORCH_STOP_AT"
# Set by the batch script when it launches the training again inside the same job (the chain
# hook's in-job restart): how many times so far. The metrics rows carry it.
IN_JOB_RESTART = "ORCH_IN_JOB_RESTART"
# The spare nodes of the job's allocation that the training's step leaves free, set by the batch
# script of a recipe with ``spare_nodes`` for each launch: a trainer that names a rank slow
# while one is free saves and stops, and the step is launched again off its node.
SPARE_NODES = "ORCH_SPARE_NODES"
# A task of a chained sweep's job arrays (orchestrator/arrays.py): the sweep's task directory,
# whose ``<task id>`` links lead to the members' run dirs and whose ``arrays.json`` names the
# links' arrays; the chain hook reads it to free a member stuck behind a task that died.
SWEEP_TASKS = "ORCH_SWEEP_TASKS"

# Seeds stay below 2**31 so that a trainer adding small offsets never passes numpy's 2**32 limit.
SEED_LIMIT = 2**31

# The rendezvous port of a job: PORT_BASE + job id % PORT_SPAN, so that jobs sharing a node differ.
# The range (10000-29999) stays below Linux's ephemeral ports (32768-60999 by default): a port in
# that range can be held by any outgoing connection on the node (a gloo or NCCL socket of the
# job before), and then neither torchrun can host the store. The templates render these numbers.
PORT_BASE = 10000
PORT_SPAN = 20000


def job_id(environ: Mapping[str, str]) -> str | None:
    """The id the chain records for the job running in ``environ``: ``<array id>_<task id>``
    for a task of a job array (its SLURM_JOB_ID is a number of the task's own, which no
    submission returned), else SLURM_JOB_ID; None outside a job."""
    array, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return environ.get("SLURM_JOB_ID") or None


def array_task(job_id: str) -> tuple[str, str] | None:
    """``(array id, task id)`` of an array task's id ``A_i``; None for a plain job's."""
    array, sep, task = job_id.partition("_")
    return (array, task) if sep and task.isdigit() else None


def port_for(job_id: str) -> str:
    """The rendezvous port of job ``job_id`` (its digits: ``1234_5`` is 12345)."""
    digits = re.sub(r"\D", "", job_id) or "0"
    return str(PORT_BASE + int(digits) % PORT_SPAN)
