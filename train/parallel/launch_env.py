"""torch.distributed's env:// variables for a member started as several tasks without torchrun.

srun (a submitit_slurm member with tasks_per_node > 1, or a recipe with ``launcher: srun``) and
submitit's local executor start one process per rank but set only their own variables. Each
process derives RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT from
them, so that every task of the member meets in one process group. Variables already set (by
torchrun, or by a batch script that exports them) win.

Not ``submitit.helpers.TorchDistributedEnvironment``, which gives the same five variables, because
it (a) only works inside a submitit job (its JobEnvironment needs SUBMITIT_EXECUTOR), while a
recipe with ``launcher: srun`` runs under a plain sbatch script; (b) takes the master address
from the job's node names, which need not resolve (the loopback cluster's ``n1``), where
SLURM_LAUNCH_NODE_IPADDR is an address; and (c) counts the job's tasks and nodes, not the step's.
"""

from __future__ import annotations

import os
import re

from contract.job_env import port_for


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``n[3-4,7],m1`` gives ``n3``."""
    match = re.match(r"([^,\[]+)(?:\[(\d+))?", nodelist)
    if match is None:
        return nodelist
    prefix, number = match.groups()
    return prefix + (number or "")


def derived_env(environ: dict[str, str]) -> dict[str, str]:
    """The rendezvous variables a multi-task member lacks; empty when nothing needs deriving."""
    if "WORLD_SIZE" in environ:
        return {}
    if int(environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1:
        tasks_per_node = environ.get("SLURM_STEP_TASKS_PER_NODE", "1").split("(")[0].split(",")[0]
        address = environ.get("SLURM_LAUNCH_NODE_IPADDR") or first_host(
            environ.get("SLURM_STEP_NODELIST", environ.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        )
        return {
            "RANK": environ["SLURM_PROCID"],
            "WORLD_SIZE": environ["SLURM_STEP_NUM_TASKS"],
            "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
            "LOCAL_WORLD_SIZE": tasks_per_node,
            "MASTER_ADDR": environ.get("MASTER_ADDR", address),
            "MASTER_PORT": environ.get("MASTER_PORT", port_for(environ.get("SLURM_JOB_ID", "0"))),
        }
    if int(environ.get("SUBMITIT_LOCAL_NTASKS", "1")) > 1:
        return {
            "RANK": environ["SUBMITIT_LOCAL_GLOBALID"],
            "WORLD_SIZE": environ["SUBMITIT_LOCAL_NTASKS"],
            "LOCAL_RANK": environ["SUBMITIT_LOCAL_LOCALID"],
            "LOCAL_WORLD_SIZE": environ["SUBMITIT_LOCAL_NTASKS"],
            "MASTER_ADDR": environ.get("MASTER_ADDR", "127.0.0.1"),
            "MASTER_PORT": environ.get(
                "MASTER_PORT", port_for(environ.get("SUBMITIT_LOCAL_JOB_ID", "0"))
            ),
        }
    return {}


def apply_launch_env() -> dict[str, str]:
    """Export the derived variables into this process's environment; returns what was set."""
    derived = derived_env(dict(os.environ))
    os.environ.update(derived)
    return derived
