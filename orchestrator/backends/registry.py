"""The one registry of backends: which exist, how ``--backend`` and ``auto`` choose, and which
backend a manifest's label stands for.

Every fact about a backend is declared on its class (see ``Backend`` in base.py); nothing here
parses labels or compares names beyond looking them up.
"""

from __future__ import annotations

import sys
from pathlib import Path

from orchestrator.backends.base import Backend
from orchestrator.backends.local import LocalBackend
from orchestrator.backends.slurm import SlurmBackend
from orchestrator.backends.submitit_local import SubmititLocalBackend
from orchestrator.backends.submitit_slurm import SubmititSlurmBackend
from orchestrator.errors import UsageError

BACKENDS: tuple[type[Backend], ...] = (
    SlurmBackend,
    LocalBackend,
    SubmititSlurmBackend,
    SubmititLocalBackend,
)
OPTIONS = ("auto", *dict.fromkeys(backend.option for backend in BACKENDS))
# Labels that manifests of earlier versions wrote for a backend now recorded under another.
OLD_LABELS = {"submitit": SubmititSlurmBackend.label}


def judged_labels() -> list[str]:
    """The backends whose chains are judged as their jobs end (``Backend.judged``)."""
    return [backend.label for backend in BACKENDS if backend.judged]


def by_label(label: str) -> type[Backend]:
    """The backend a manifest's ``backend`` field names."""
    label = OLD_LABELS.get(label, label)
    for backend in BACKENDS:
        if backend.label == label:
            return backend
    known = ", ".join(backend.label for backend in BACKENDS)
    raise UsageError(f"backend {label!r} is unknown: this version knows {known}")


def for_run_dir(label: str, run_dir: Path | str) -> Backend:
    """The backend that ran a chain, to ask it about the chain's jobs."""
    return by_label(label).for_run_dir(Path(run_dir))


def candidates_for(option: str) -> list[type[Backend]]:
    """The backends ``--backend OPTION`` may pick, before knowing whether SLURM answers."""
    if option not in OPTIONS:
        raise UsageError(f"--backend {option!r}: choose one of {', '.join(OPTIONS)}")
    return [
        backend
        for backend in BACKENDS
        if (backend.auto if option == "auto" else backend.option == option)
    ]


def choose(option: str, has_slurm: bool) -> type[Backend]:
    """The backend ``--backend OPTION`` picks: among its candidates, the one that goes through
    SLURM when a controller answers and the one on this machine otherwise."""
    candidates = candidates_for(option)
    fitting = [backend for backend in candidates if backend.runs_here != has_slurm]
    here = [backend for backend in candidates if backend.runs_here]
    if not fitting and not here:
        raise UsageError(
            f"--backend {option}: no SLURM controller answers (sinfo failed); start one with "
            "`orchestrator cluster up` and export SLURM_CONF, or use --backend local"
        )
    chosen = (fitting or here)[0]
    if option == "auto":
        why = "a SLURM controller answered" if has_slurm else "no SLURM controller answered"
    else:
        why = "chosen"
    where = "jobs run on this machine" if chosen.runs_here else "jobs go to SLURM"
    print(f"backend: {chosen.label} ({why}): {where}", file=sys.stderr, flush=True)
    return chosen
