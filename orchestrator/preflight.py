"""Checks made before anything is submitted. Each failure is one UsageError naming the problem."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from orchestrator.backends.base import DEPENDENCY_KINDS
from orchestrator.errors import UsageError
from orchestrator.slurm.resources import JobResources

MAX_CHAIN_LENGTH = 1000


def check_num_jobs(num_jobs: int) -> None:
    if num_jobs < 1:
        raise UsageError(f"-n {num_jobs}: a chain needs at least 1 job")
    if num_jobs > MAX_CHAIN_LENGTH:
        raise UsageError(f"-n {num_jobs}: more than {MAX_CHAIN_LENGTH} jobs in one chain")


def check_dependency(kind: str) -> None:
    if kind not in DEPENDENCY_KINDS:
        raise UsageError(f"--dependency {kind!r}: choose one of {', '.join(DEPENDENCY_KINDS)}")


def check_job_name(name: str) -> None:
    """SLURM job names, log and script file names are made from it: keep it plain."""
    if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise UsageError(f"job name {name!r}: use letters, digits, '-', '_' and '.' only")


def check_run_dir(run_dir: Path) -> None:
    """The run dir (or the nearest folder that exists above it) must be a writable directory."""
    if "," in str(run_dir):
        raise UsageError(f"run dir {run_dir}: a ',' cannot pass through sbatch --export; rename it")
    if run_dir.exists() and not run_dir.is_dir():
        raise UsageError(f"run dir {run_dir} exists and is not a directory")
    existing = run_dir
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(
            f"run dir {run_dir}: {existing} is not writable; choose --run-dir elsewhere"
        )


def check_programs(programs: Sequence[str]) -> None:
    """Each program a job starts by name must be on this shell's PATH, which the jobs inherit
    (sbatch exports it, the local backend runs them here): else every job would exit 127."""
    for program in programs:
        if shutil.which(program) is None:
            raise UsageError(
                f"{program} is not on PATH, and the jobs would run it from this shell's PATH: "
                "activate the environment the toolkit is installed in (source .venv/bin/activate)"
                " and launch again"
            )


def check_local_resources(resources: JobResources) -> None:
    """The local backends emulate one node with this machine's GPUs."""
    if resources.nodes > 1:
        raise UsageError(
            f"the recipe asks for {resources.nodes} nodes; the local backend runs one node: use "
            "the slurm backend (`orchestrator cluster up` starts a loopback cluster)"
        )
    if resources.gpus_per_node > 0 and not Path("/dev/nvidia0").exists():
        raise UsageError("the recipe asks for GPUs and this machine has none")
