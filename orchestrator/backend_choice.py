"""Which backend runs a chain, and whether the chain's request fits the machines it would use."""

from __future__ import annotations

import sys
from pathlib import Path

from orchestrator.backends.base import Backend
from orchestrator.errors import UsageError
from orchestrator.preflight import check_local_resources, check_resources, parse_partitions

BACKEND_CHOICES = ("auto", "slurm", "local", "submitit")


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def choose_backend(requested: str, run_dir: Path, has_slurm: bool) -> Backend:
    if requested not in BACKEND_CHOICES:
        raise UsageError(f"--backend {requested!r}: choose one of {', '.join(BACKEND_CHOICES)}")
    if requested == "slurm" and not has_slurm:
        raise UsageError(
            "--backend slurm: no SLURM controller answers (sinfo failed); start one with "
            "`orchestrator cluster up` and export SLURM_CONF, or use --backend local"
        )
    if requested == "submitit":
        from orchestrator.backends.submitit_backend import SubmititBackend

        kind = "slurm" if has_slurm else "local"
        say(f"backend: submitit ({kind} executor)")
        return SubmititBackend(run_dir / "submitit", cluster=kind)
    if requested == "slurm" or (requested == "auto" and has_slurm):
        from orchestrator.backends.slurm import SlurmBackend

        reason = "chosen" if requested == "slurm" else "sbatch answered"
        say(f"backend: slurm ({reason})")
        return SlurmBackend()
    from orchestrator.backends.local import LocalBackend

    reason = "chosen" if requested == "local" else "no SLURM controller answered"
    say(f"backend: local ({reason}): jobs run one after another on this machine")
    return LocalBackend()


def check_backend_resources(
    backend: Backend, directives: dict[str, str], sinfo_table: str | None
) -> None:
    """Preflight, part two: the request must fit the machines the backend will use."""
    if sinfo_table is None or backend.name == "local" or getattr(backend, "cluster", "") == "local":
        check_local_resources(directives)
    else:
        check_resources(directives, parse_partitions(sinfo_table))
