"""A chain as both programs show it: the backend to ask about its jobs, its ``--json`` summary,
and the tables' cells and labels."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from orchestrator.backends import registry
from orchestrator.backends.base import Backend, JobStatus
from orchestrator.chain_status import ChainStatus
from orchestrator.manifest import Manifest


def backend_for(manifest: Manifest) -> Backend:
    """The backend that ran a chain, to ask it about the chain's jobs."""
    return registry.for_run_dir(manifest.backend, manifest.run_dir)


def looked_at(manifests: list[Manifest]) -> list[tuple[Backend, dict[str, JobStatus]]]:
    """Each chain's backend (its ``unreachable`` fields set) and job states, from one look at
    each scheduler for all the chains' jobs (``Backend.look_at``): a sweep of any size asks
    SLURM the same few questions."""
    kinds = [registry.by_label(manifest.backend) for manifest in manifests]
    asked: dict[Callable[[list[str]], Any], list[str]] = {}
    for kind, manifest in zip(kinds, manifests, strict=True):
        if kind.look_at is not None:
            asked.setdefault(kind.look_at, []).extend(manifest.job_ids())
    seen = {look_at: look_at(job_ids) for look_at, job_ids in asked.items()}
    looked = []
    for kind, manifest in zip(kinds, manifests, strict=True):
        backend = kind.for_run_dir(Path(manifest.run_dir))
        looked.append((backend, backend.statuses(manifest.job_ids(), seen.get(kind.look_at))))
    return looked


def summary(manifest: Manifest, statuses: dict[str, JobStatus], found: ChainStatus) -> dict:
    """A chain as ``--json`` prints it; ``found``: its status (``chain_status``)."""
    return {
        "chain_id": manifest.chain_id,
        "run_dir": manifest.run_dir,
        "backend": manifest.backend,
        "status": found.status,
        "code": {
            "mode": manifest.code_mode,
            "dir": manifest.code_dir,
            "commit": manifest.git_sha,
            "dirty": manifest.git_dirty,
            "diff": manifest.code_diff,
        },
        "jobs": [
            {
                "index": job.index,
                "job_id": job.job_id,
                "seed": job.seed,
                "dependency": job.dependency,
                "state": statuses[job.job_id].state if job.job_id in statuses else None,
                "then": job.then,
            }
            for job in manifest.jobs
        ],
    }


def status_line(found: ChainStatus) -> str:
    """``failed: job 1 (id 7), the last, ...``: a chain's status and, once ended, how."""
    return f"{found.status}: {found.why}" if found.why else found.status


def code_line(code: dict) -> str:
    """What the chain's jobs run, in one line: the commit, dirty or not, and from where."""
    commit = (code["commit"] or "no commit")[:12] + (" (dirty)" if code["dirty"] else "")
    where = {"snapshot": f"snapshot {code['dir']}", "dir": f"from {code['dir']}"}
    return f"code: {commit}, {where.get(code['mode'] or '', 'live tree')}"


def format_loss(loss: float | None) -> str:
    return "-" if loss is None else f"{loss:.4f}"


def print_table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(str(row[col])) for row in [header, *rows]) for col in range(len(header))]
    for row in [header, *rows]:
        print(
            "  ".join(
                str(cell).ljust(width) for cell, width in zip(row, widths, strict=False)
            ).rstrip()
        )


def index_label(index: int, then: bool) -> str:
    """A job's index as the tables show it: a ``--then`` job is marked."""
    return f"{index} (then)" if then else str(index)


def jobs_label(manifest: Manifest) -> str:
    """The chain's length, ``3+then`` for a chain that ends with a --then job."""
    return f"{manifest.num_jobs}+then" if manifest.then else str(manifest.num_jobs)
