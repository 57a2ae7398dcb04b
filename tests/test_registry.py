"""The backend registry: labels, the choice of --backend, and manifests of earlier versions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.backends import registry
from orchestrator.backends.local import LocalBackend
from orchestrator.backends.slurm import SlurmBackend
from orchestrator.backends.submitit_local import SubmititLocalBackend
from orchestrator.backends.submitit_slurm import SubmititSlurmBackend
from orchestrator.cli.follow_logs import log_path
from orchestrator.errors import UsageError
from orchestrator.manifest import Manifest

# A manifest as the version before the registry wrote it (main at 6eef58c), trimmed to one job.
OLD_MANIFEST = {
    "args": [],
    "backend": "submitit",
    "base_seed": 5,
    "chain_id": "note_job-20261122-101010-ab12",
    "created": 1795000000.0,
    "dependency_kind": "afterany",
    "error": None,
    "git_dirty": False,
    "git_sha": "6eef58c",
    "jobs": [
        {"dependency": None, "index": 0, "job_id": "4242", "seed": 77, "submit_time": 1795000001.0}
    ],
    "num_jobs": 1,
    "recipe": "/somewhere/jobs.py",
    "recipe_sha256": "0" * 64,
    "run_dir": "RUN_DIR",
    "script": "python:jobs.note_job",
    "status": "submitted",
    "sweep_id": None,
}


@pytest.mark.parametrize(
    ("label", "kind"),
    [
        ("slurm", SlurmBackend),
        ("local", LocalBackend),
        ("submitit:slurm", SubmititSlurmBackend),
        ("submitit:local", SubmititLocalBackend),
        ("submitit", SubmititSlurmBackend),  # written before the backend was split
    ],
)
def test_every_label_a_manifest_holds_names_its_backend(label: str, kind: type) -> None:
    assert registry.by_label(label) is kind
    assert isinstance(registry.for_run_dir(label, "/tmp/run"), kind)


def test_labels_are_unique_and_each_backend_declares_itself() -> None:
    labels = [backend.label for backend in registry.BACKENDS]
    assert len(set(labels)) == len(labels)
    assert registry.OPTIONS == ("auto", "slurm", "local", "submitit")
    with pytest.raises(UsageError, match="'pbs' is unknown"):
        registry.by_label("pbs")


@pytest.mark.parametrize(
    ("option", "has_slurm", "kind"),
    [
        ("auto", True, SlurmBackend),
        ("auto", False, LocalBackend),
        ("slurm", True, SlurmBackend),
        ("local", True, LocalBackend),
        ("local", False, LocalBackend),
        ("submitit", True, SubmititSlurmBackend),
        ("submitit", False, SubmititLocalBackend),
    ],
)
def test_choose(option: str, has_slurm: bool, kind: type) -> None:
    assert registry.choose(option, has_slurm) is kind


def test_slurm_without_a_controller_is_refused() -> None:
    with pytest.raises(UsageError, match="no SLURM controller answers"):
        registry.choose("slurm", has_slurm=False)


def test_an_old_manifest_loads_and_finds_its_logs(tmp_path: Path) -> None:
    data = {**OLD_MANIFEST, "run_dir": str(tmp_path)}
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    log = tmp_path / "submitit" / "4242_0_log.out"
    log.parent.mkdir()
    log.write_text("hello\n")
    manifest = Manifest.load(tmp_path / "manifest.json")
    assert manifest.backend == "submitit" and manifest.jobs[0].job_id == "4242"
    backend = registry.for_run_dir(manifest.backend, manifest.run_dir)
    assert isinstance(backend, SubmititSlurmBackend)
    assert backend.folder == tmp_path / "submitit"
    assert log_path(manifest, manifest.jobs[0]) == log
