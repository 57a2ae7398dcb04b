"""The session's loopback SLURM cluster: its handle, its command line, and its queue."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from orchestrator import processes
from orchestrator.cluster import queries
from orchestrator.cluster.daemons import running_clusters
from orchestrator.cluster.lifecycle import down
from tests.harness.process import REPO

# Inherited by the daemons of the session's clusters: names the pytest process that owns them.
SESSION_ENV = "ORCH_TEST_SESSION_PID"


@dataclass(frozen=True)
class LoopbackCluster:
    directory: Path
    conf: Path
    env: dict[str, str]  # os.environ plus SLURM_CONF, for subprocesses

    def queue_job_ids(self) -> list[str]:
        return queries.queue_job_ids(self.conf)


def cluster_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``orchestrator cluster ARGS`` run as a user would, from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "cluster", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=timeout,
    )


def down_clusters_of_dead_sessions() -> None:
    """A session killed before its teardown leaves its cluster running: stop those, and only
    those (other sessions on the machine may be running their own)."""
    for directory, environ in running_clusters().items():
        owner = environ.get(SESSION_ENV, "")
        if owner.isdigit() and not processes.alive(int(owner)):
            down(directory)


def open_to_every_user(directory: Path) -> None:
    """Let every Unix user use the cluster in ``directory``, as on a real one: its files
    readable, the way to them traversable (not listable). slurmstepd runs a job's script from
    the spool in there as the job's user, and that user's commands read slurm.conf."""
    directory.chmod(0o755)
    for parent in directory.parents:
        if parent == Path(tempfile.gettempdir()) or parent == parent.parent:
            break
        parent.chmod(parent.stat().st_mode | 0o011)


def queue_reasons() -> dict[str, str]:
    """Each queued job's id (an array's tasks one each) and SLURM's reason for its state
    (``None`` while it runs)."""
    completed = subprocess.run(
        ["squeue", "--noheader", "--array", "--format=%i %r"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert completed.returncode == 0, completed.stderr
    return dict(line.split(maxsplit=1) for line in completed.stdout.splitlines() if line.strip())


def queue_ids() -> list[str]:
    return list(queue_reasons())


def wait_gone(job_ids: list[str], timeout: float = 30) -> None:
    """Wait until none of ``job_ids`` is still in the queue (cancelled jobs linger briefly)."""
    deadline = time.monotonic() + timeout
    while set(queue_ids()) & set(job_ids):
        if time.monotonic() > deadline:
            raise AssertionError(
                f"jobs still queued after {timeout} s: {set(queue_ids()) & set(job_ids)}"
            )
        time.sleep(0.5)


# The SLURM commands whose calls ``counted_slurm`` records.
COUNTED = ("sbatch", "squeue", "sacct", "scontrol", "scancel")


def counted_slurm(directory: Path) -> tuple[dict[str, str], Path]:
    """An environment whose PATH runs SLURM's query and cancel commands through wrappers that
    record each call (``name args``, a line each) before running the real command, and the
    file they record to."""
    directory.mkdir(parents=True, exist_ok=True)
    calls = directory / "calls.log"
    calls.touch()
    for name in COUNTED:
        real = shutil.which(name)
        assert real, f"{name} is not on PATH"
        wrapper = directory / name
        wrapper.write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\nexec {real} "$@"\n')
        wrapper.chmod(0o755)
    return {"PATH": f"{directory}{os.pathsep}{os.environ['PATH']}"}, calls


def calls_of(calls: Path) -> list[str]:
    """What ``counted_slurm``'s wrappers recorded since the file was last emptied (then empty
    it): ``scontrol ping`` and ``scontrol show`` apart, every other command by its name."""
    lines = calls.read_text().splitlines()
    calls.write_text("")
    return [
        " ".join(line.split()[:2]) if line.startswith("scontrol") else line.split()[0]
        for line in lines
    ]
