"""The launch's checks of its arguments, its run dir and this machine, made before anything is
submitted. Each failure is one UsageError naming the problem.

``ChainPlan.create`` (orchestrator.chain) runs the chain's: -n, --dependency, the job name,
--retries, --retry-on-exit, --max-stalled, --restarts-in-job, --exclude-slow-nodes,
--readmit-slow-nodes and the run dir;
``launch.check_jobs`` those of where the jobs go: the programs on PATH, this machine's resources
for a local backend, --retries against the chosen backend.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from orchestrator.backends import registry
from orchestrator.backends.base import DEPENDENCY_KINDS, Backend
from orchestrator.errors import UsageError
from orchestrator.slow_nodes import MAX_EXCLUDE_SLOW_NODES
from orchestrator.slurm.resources import JobResources

MAX_CHAIN_LENGTH = 1000
# What a batch script runs to take part in self-healing (docs/contracts.md, "The chain hook").
HOOK_MODULE = "orchestrator.chain_hooks"
MAX_RETRIES = 1000  # as many as -n allows jobs
MAX_RESTARTS_IN_JOB = 100


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


def check_retries(retries: int, dependency_kind: str, script_text: str | None) -> None:
    """--retries needs jobs that run the chain hook, and a chain that goes on after a failure."""
    if not 0 <= retries <= MAX_RETRIES:
        raise UsageError(f"--retries {retries}: give 0..{MAX_RETRIES}")
    if retries == 0:
        return
    if dependency_kind == "afterok":
        raise UsageError(
            "--retries needs --dependency afterany or singleton: under afterok a failed job "
            "leaves the rest of the chain pending forever, replacements included"
        )
    if script_text is None or HOOK_MODULE not in script_text:
        raise UsageError(
            f"--retries: the recipe never runs the chain hook ({HOOK_MODULE}), so no job could "
            "queue a replacement; use a YAML recipe, or call the hook from the .sub "
            "(docs/contracts.md, the chain hook)"
        )


def parse_exit_codes(text: str, retries: int) -> tuple[int, ...]:
    """--retry-on-exit's comma-separated exit codes (1..255)."""
    if not text:
        return ()
    words = [word.strip() for word in text.split(",")]
    if not all(word.isdigit() and 1 <= int(word) <= 255 for word in words):
        raise UsageError(
            f"--retry-on-exit {text!r}: give exit codes 1..255, comma-separated (e.g. 1,137)"
        )
    if retries == 0:
        raise UsageError("--retry-on-exit lists codes worth a retry: give --retries K too")
    return tuple(sorted({int(word) for word in words}))


def check_max_stalled(max_stalled: int) -> None:
    if not 0 <= max_stalled <= MAX_RETRIES:
        raise UsageError(f"--max-stalled {max_stalled}: give 0 (never stop) .. {MAX_RETRIES}")


def check_restarts_in_job(restarts: int) -> None:
    if not 0 <= restarts <= MAX_RESTARTS_IN_JOB:
        raise UsageError(
            f"--restarts-in-job {restarts}: give 0 (never restart in place) .. "
            f"{MAX_RESTARTS_IN_JOB}"
        )


def check_slow_nodes(cap: int, readmit_after: int) -> None:
    """--exclude-slow-nodes and --readmit-slow-nodes (orchestrator/slow_nodes.py)."""
    if not 0 <= cap <= MAX_EXCLUDE_SLOW_NODES:
        raise UsageError(
            f"--exclude-slow-nodes {cap}: give 0 (never exclude a node) .. {MAX_EXCLUDE_SLOW_NODES}"
        )
    if not 0 <= readmit_after <= MAX_CHAIN_LENGTH:
        raise UsageError(
            f"--readmit-slow-nodes {readmit_after}: give 0 (never take a slow node back) .. "
            f"{MAX_CHAIN_LENGTH} jobs"
        )


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
    if resources.allocated > 1:
        raise UsageError(
            f"the recipe asks for {resources.allocated} nodes; the local backend runs one node: "
            "use the slurm backend (`orchestrator cluster up` starts a loopback cluster)"
        )
    if resources.gpus_per_node > 0 and not Path("/dev/nvidia0").exists():
        raise UsageError("the recipe asks for GPUs and this machine has none")


def check_backend_retries(retries: int, backend: type[Backend]) -> None:
    """--retries against the backend the launch chose: only a judged chain replaces its jobs."""
    if retries and not backend.judged:
        raise UsageError(
            f"--retries needs the {' or '.join(registry.judged_labels())} backend, whose chains "
            f"replace their failed jobs; this chain would run on {backend.label}"
        )
