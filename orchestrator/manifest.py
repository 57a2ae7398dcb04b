"""The chain manifest and the index of chains.

The manifest (``manifest.json`` in the chain's run dir) is the chain's record: what was submitted,
with which seeds, from which commit. Every write goes to a temporary file in the same directory and
is renamed into place, so a reader never sees a torn file. While a chain is being submitted, each
accepted job is also appended to the journal beside it (one JSON line, a constant cost per job
however long the chain), which ``Manifest.load`` folds in and the next full write replaces, so a
launch killed halfway still has every queued job on record. The index is one small JSON file per
chain under ``$ORCH_HOME/chains/``; one file per chain means concurrent launches never share a file.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from contract import job_env
from orchestrator.slow_nodes import NodeDecision

# Jobs in a row that may end without a newer checkpoint before the chain stops as stalled.
DEFAULT_MAX_STALLED = 2
# Launches of the training again inside one job after a failure a new process fixes
# (orchestrator/in_job.py). Two: a failure that repeats at the same place is handed to the
# chain after one restart whatever this is, so a second restart only ever serves a second,
# different failure in the same job, which on a large allocation over hours is common.
DEFAULT_RESTARTS_IN_JOB = 2
MANIFEST_NAME = "manifest.json"
# A chain's status (``Manifest.status``). auto_launch sets SUBMITTING, then SUBMITTED, or
# ROLLED_BACK: its submission failed part way, what it had queued is cancelled, and the chain
# hook lets no job of it train should a cancel not have reached the scheduler. The chain's
# judgement (orchestrator/chain_judgement.py) sets one of ENDED_STATUSES when it ends, and
# `orchestrator cancel` CANCELLED. QUEUED and RUNNING are never stored: `status` and `list`
# derive them from the jobs' states while a chain is SUBMITTED (orchestrator/chain_status.py).
SUBMITTING, SUBMITTED, ROLLED_BACK = "submitting", "submitted", "rolled_back"
COMPLETE = "complete"  # training finished (or, for a command of its own, every job completed)
DIVERGED = "diverged"  # the training diverged: no retry
BLOCKED = "blocked"  # a failure a new job would repeat (the config refused, no disk): no retry
STALLED = "stalled"  # --max-stalled jobs in a row without a newer checkpoint
INCOMPLETE = "incomplete"  # the last job stopped after saving, training unfinished
FAILED = "failed"  # the last job failed, and nothing replaces it
CANCELLED = "cancelled"  # by `orchestrator cancel`, or no job of it ran
ENDED_STATUSES = (COMPLETE, DIVERGED, BLOCKED, STALLED, INCOMPLETE, FAILED, CANCELLED)
FAILED_STATUSES = (DIVERGED, BLOCKED, STALLED, FAILED)  # a local chain's auto_launch exits 3
QUEUED, RUNNING = "queued", "running"
JOURNAL_NAME = ".manifest.jobs"  # jobs accepted since the manifest's last full write
LOCK_NAME = ".chain.lock"  # held by whoever rewrites a submitted chain's manifest


def orch_home() -> Path:
    """The state directory: ``$ORCH_HOME``, else ``~/.orchestrator``."""
    return Path(os.environ.get(job_env.HOME) or Path.home() / ".orchestrator")


def atomic_write_json(path: Path, payload: Any, durable: bool = True) -> None:
    """Write via a temp file and rename: readers see the old or the new file, never a torn one.

    ``durable`` also fsyncs, so the file survives a crash of the machine; progress updates that a
    final durable write will follow can skip that cost.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(payload, handle, indent=2, sort_keys=True)
            handle.write("\n")
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def known_fields(kind: type, data: dict[str, Any]) -> dict[str, Any]:
    names = {item.name for item in fields(kind)}
    return {key: value for key, value in data.items() if key in names}


@dataclass
class JobRecord:
    index: int
    seed: int
    job_id: str | None = None
    dependency: str | None = None
    submit_time: float | None = None
    then: bool = False  # the job auto_launch --then queued after the chain's last
    # Set once by the chain hook when the job has ended (orchestrator.chain_hooks): finished,
    # stopped, completed, failed, blocked, diverged or not_started. Its idempotency key.
    outcome: str | None = None
    why: str | None = None  # the outcome's line ("training failed at step 3 (exit 1): error: ...")
    replaces: int | None = None  # a replacement (--retries): the index of the failed job
    reason: str | None = None  # a replacement: why the job it replaces failed
    # Set with the outcome: the training's last step (its end-of-job record), the newest complete
    # checkpoint then, and whether the job's progress was measured (a record or checkpoints).
    step: int | None = None
    checkpoint_step: int | None = None
    measured: bool = False
    restarts: int = 0  # times SLURM requeued the job (preempted under `requeue: true`)
    # Times the batch script launched the training again inside the job (orchestrator/in_job.py),
    # and the failure it last did so for: the same failure again goes to the chain's logic.
    in_job_restarts: int = 0
    restarted_for: str | None = None
    # A failure whose replacement SLURM did not take (its controller down past the patience):
    # why the job failed, until a later hook run (a job's start, `chain_hooks check`) queues it.
    replacement_due: str | None = None
    # The ranks its trainer named slow (its end-of-job record's ``slow``): node, rank, ratio.
    slow: list[dict[str, Any]] = field(default_factory=list)
    # The nodes the chain's hook had it stay off (its --exclude, less the recipe's own).
    avoids: list[str] = field(default_factory=list)


@dataclass
class ThenRecord:
    """What the --then job runs: its recipe, that file's hash, its script copy."""

    recipe: str
    recipe_sha256: str
    script: str


@dataclass
class Manifest:
    chain_id: str
    recipe: str
    recipe_sha256: str
    script: str
    run_dir: str
    backend: str
    dependency_kind: str
    num_jobs: int
    args: list[str]
    base_seed: int | None
    git_sha: str | None
    git_dirty: bool | None
    created: float
    status: str = SUBMITTING
    error: str | None = None
    sweep_id: str | None = None
    then: ThenRecord | None = None
    retries: int = 0  # --retries: replacement jobs the chain may queue for failed ones
    retry_on_exit: list[int] = field(default_factory=list)  # --retry-on-exit: codes worth one
    max_stalled: int = DEFAULT_MAX_STALLED  # --max-stalled (orchestrator.chain_judgement)
    # --restarts-in-job: launches of the training again inside one job (orchestrator/in_job.py).
    # A manifest written before it existed had none.
    restarts_in_job: int = 0
    # --exclude-slow-nodes / --readmit-slow-nodes (orchestrator/slow_nodes.py): a manifest
    # written before they existed excludes no node.
    exclude_slow_nodes: int = 0
    readmit_slow_nodes: int = 0
    # What the chain made of each node a job's trainer named slow (left out, or kept and why).
    slow_nodes: list[NodeDecision] = field(default_factory=list)
    start_step: int | None = None  # the run dir's newest complete checkpoint at submission
    workdir: str | None = None  # where the jobs start (sbatch --chdir), for replacements
    code_mode: str | None = None  # snapshot, dir or live (orchestrator/snapshot.py)
    code_dir: str | None = None  # ORCH_CODE_DIR: the snapshot or --code DIR (None: live)
    code_diff: str | None = None  # the snapshot's uncommitted changes (RUN_DIR/code.diff)
    ended: str | None = None  # why the chain ended, in a line (ENDED_STATUSES)
    jobs: list[JobRecord] = field(default_factory=list)

    @property
    def path(self) -> Path:
        return Path(self.run_dir) / MANIFEST_NAME

    @property
    def journal_path(self) -> Path:
        return Path(self.run_dir) / JOURNAL_NAME

    def save(self, durable: bool = True) -> None:
        atomic_write_json(self.path, asdict(self), durable=durable)
        self.journal_path.unlink(missing_ok=True)  # every job it held is in the manifest now

    def record_job(self, job: JobRecord) -> None:
        """Add an accepted job and put it on record at once, without rewriting the manifest."""
        self.jobs.append(job)
        with open(self.journal_path, "a") as handle:
            handle.write(json.dumps(asdict(job)) + "\n")

    @classmethod
    def load(cls, path: Path) -> Manifest:
        """Read a manifest and its journal; fields this version does not know (older or newer
        ones) are ignored."""
        data = json.loads(Path(path).read_text())
        jobs = [JobRecord(**known_fields(JobRecord, job)) for job in data.pop("jobs", [])]
        jobs += journal_jobs(Path(path).parent / JOURNAL_NAME, {job.job_id for job in jobs})
        then = data.pop("then", None)
        then_record = ThenRecord(**known_fields(ThenRecord, then)) if then else None
        nodes = [NodeDecision(**known_fields(NodeDecision, d)) for d in data.pop("slow_nodes", [])]
        return cls(**known_fields(cls, data), jobs=jobs, then=then_record, slow_nodes=nodes)

    def job_ids(self) -> list[str]:
        return [job.job_id for job in self.jobs if job.job_id]


def journal_jobs(path: Path, known_ids: set[str | None]) -> list[JobRecord]:
    """The journal's jobs that the manifest does not hold yet. A launch killed while appending
    leaves at most its last line torn: that line is skipped (its job was not on record)."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    jobs = []
    for line in lines:
        try:
            job = JobRecord(**known_fields(JobRecord, json.loads(line)))
        except (json.JSONDecodeError, TypeError):
            continue
        if job.job_id not in known_ids:
            jobs.append(job)
    return jobs


@contextmanager
def chain_lock(run_dir: Path | str) -> Iterator[None]:
    """Hold the run dir's chain lock: auto_launch while it submits, a chain hook while it
    reads, decides and rewrites the manifest, so two writers never lose each other's update."""
    with open(Path(run_dir) / LOCK_NAME, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def index_path(chain_id: str) -> Path:
    return orch_home() / "chains" / f"{chain_id}.json"


def register_chain(manifest: Manifest) -> None:
    atomic_write_json(
        index_path(manifest.chain_id),
        {"chain_id": manifest.chain_id, "run_dir": manifest.run_dir, "created": manifest.created},
    )


def find_manifest(chain_id: str) -> Manifest:
    """Load a chain's manifest by id (from the index) or by a run dir path."""
    from orchestrator.errors import UsageError

    as_path = Path(chain_id)
    if (as_path / MANIFEST_NAME).is_file():
        return Manifest.load(as_path / MANIFEST_NAME)
    entry = index_path(chain_id)
    if not entry.is_file():
        raise UsageError(
            f"unknown chain or sweep {chain_id!r}: not in {entry.parent} and not a run dir; "
            "see `orchestrator list`"
        )
    run_dir = Path(json.loads(entry.read_text())["run_dir"])
    if not (run_dir / MANIFEST_NAME).is_file():
        raise UsageError(f"chain {chain_id!r}: its manifest {run_dir / MANIFEST_NAME} is gone")
    return Manifest.load(run_dir / MANIFEST_NAME)


# What every entry of an index holds, by kind: an entry without it is left out of a listing.
INDEX_KEYS = {
    "chains": ("chain_id", "run_dir", "created"),
    "sweeps": ("sweep_id", "members", "created"),
}


def read_index(kind: str) -> list[dict[str, Any]]:
    """The entries of ``$ORCH_HOME/<kind>/`` (chains or sweeps), oldest first. A file that is
    not such an entry (not JSON, a key missing) is left out with one line on stderr naming it,
    so that one broken file does not hide every other chain."""
    folder = orch_home() / kind
    if not folder.is_dir():
        return []
    entries = []
    for path in sorted(folder.glob("*.json")):
        try:
            entry = json.loads(path.read_text())
        except ValueError:
            why = "is not JSON"
        else:
            missing = [
                key for key in INDEX_KEYS[kind] if not isinstance(entry, dict) or key not in entry
            ]
            why = f"has no {', '.join(missing)}" if missing else ""
        if why:
            print(
                f"warning: {kind[:-1]} index {path} {why}: left out; remove or fix it",
                file=sys.stderr,
            )
            continue
        entries.append(entry)
    return sorted(entries, key=lambda entry: entry["created"])


def list_chains() -> list[dict[str, Any]]:
    return read_index("chains")


def sweep_index_path(sweep_id: str) -> Path:
    return orch_home() / "sweeps" / f"{sweep_id}.json"


def register_sweep(sweep_id: str, members: list[dict[str, Any]]) -> Path:
    """Record a sweep: its members' chain ids, run dirs and overrides, in one atomic file."""
    import time

    path = sweep_index_path(sweep_id)
    atomic_write_json(path, {"sweep_id": sweep_id, "created": time.time(), "members": members})
    return path


def sweep_members(name: str) -> list[dict[str, Any]] | None:
    """The members of the sweep called ``name``, or None when ``name`` is no sweep id.

    Only a bare name can be a sweep id: a path (a run dir, absolute or relative) is never
    looked up, as joining it onto the sweeps folder would find ``<path>.json`` beside it.
    """
    from orchestrator.errors import UsageError

    if not name or Path(name).name != name or name in (".", ".."):
        return None
    path = sweep_index_path(name)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError as error:
        raise UsageError(f"sweep index {path} is not JSON ({error}); remove or fix it") from None
    members = data.get("members") if isinstance(data, dict) else None
    if not isinstance(members, list) or not all(
        isinstance(member, dict) and isinstance(member.get("chain_id"), str) for member in members
    ):
        raise UsageError(
            f"sweep index {path} has no list of members with a chain_id each; remove or fix it"
        )
    return members


def find_manifests(name: str) -> list[Manifest]:
    """The manifests a name stands for: every chain of a sweep, or the one chain."""
    members = sweep_members(name)
    if members is not None:
        return [find_manifest(member["chain_id"]) for member in members]
    return [find_manifest(name)]


def member_manifest(name: str, member: int) -> Manifest:
    """Member ``member`` (0-based, in the sweep's order: the run dir ``<sweep dir>/<member>``)
    of the sweep called ``name``."""
    from orchestrator.errors import UsageError

    members = sweep_members(name)
    if members is None:
        raise UsageError(f"--member {member}: {name!r} is no sweep; a chain is cancelled whole")
    if not 0 <= member < len(members):
        raise UsageError(f"--member {member}: sweep {name} has members 0..{len(members) - 1}")
    return find_manifest(members[member]["chain_id"])


def sweep_labels(name: str) -> dict[str, str] | None:
    """Chain id -> the overrides that tell it from the other members (else its id) for a sweep;
    None when ``name`` is no sweep. Overrides every member shares would only crowd a legend."""
    members = sweep_members(name)
    if members is None:
        return None
    override_lists = [m.get("overrides") or [] for m in members]
    shared = set.intersection(*map(set, override_lists)) if len(members) > 1 else set()
    return {
        m["chain_id"]: " ".join(o for o in overrides if o not in shared) or m["chain_id"]
        for m, overrides in zip(members, override_lists, strict=True)
    }


def list_sweeps() -> list[dict[str, Any]]:
    return read_index("sweeps")
