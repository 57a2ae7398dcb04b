"""Where a run dir's checkpoints are, for everyone who reads them: the trainer, its preflight,
the evaluation and export, and the orchestrator's judgement of a chain (its newest complete
step, the interval between its checkpoints, ``status``).

By default a run's checkpoints are ``RUN_DIR/checkpoints``. With ``checkpoint.location`` an
``s3://bucket/prefix`` they go to object storage, under a prefix of the run's own (the run dir's
absolute path after the location's prefix: every run dir of a sweep, every chain, its own), and
the first job records that prefix in ``RUN_DIR/checkpoint_location`` (no credentials: those
come from the environment only). Everyone else reads the record, so ``orchestrator status`` and
the chain's hooks list the same bucket the trainer writes. A run dir keeps its location: a
config that names another one is refused before any process starts.

Torch-free; boto3 is imported only for a run in object storage.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from contract.run_dir import (
    CHECKPOINT_LOCATION_FILE,
    CHECKPOINTS_DIR,
    MARKER,
    STATE_FILE,
    STEP_DIR,
    complete_checkpoints,
)
from train.data.storage import (
    StorageError,
    check_bucket,
    get_bytes,
    is_url,
    join,
    listing,
    refusal,
)

Ref = Path | str  # a checkpoint: a directory, or an s3:// prefix


class LocationError(ValueError):
    """A checkpoint location that cannot be used: one line naming it and what to set."""


def checkpoint_name(checkpoint: Ref) -> str:
    """``step_4``, wherever the checkpoint is."""
    return str(checkpoint).rstrip("/").rsplit("/", 1)[-1]


def prefix_for(location: str, run_dir: Path) -> str:
    """The run's own prefix under ``location``."""
    return join(location, str(Path(run_dir).resolve()).lstrip("/"))


def recorded(run_dir: Path) -> str | None:
    """The object-storage prefix the run dir's checkpoints are in, or None (on disk)."""
    record = Path(run_dir) / CHECKPOINT_LOCATION_FILE
    return record.read_text().strip() if record.is_file() else None


def settle(run_dir: Path, location: str, first_rank: bool) -> str | None:
    """Check ``checkpoint.location`` against the run dir (and its bucket, with metadata
    requests only); ``first_rank`` records it. The run's prefix, or None for the run dir's own
    ``checkpoints/``. Raises LocationError."""
    run_dir = Path(run_dir)
    before = recorded(run_dir)
    if not location:
        if before is not None:
            raise LocationError(
                f"run_dir={run_dir} keeps its checkpoints in {before}: set "
                f"checkpoint.location to its location, or use a new run_dir"
            )
        return None
    check_location(location)
    prefix = prefix_for(location, run_dir)
    if before is not None and before != prefix:
        raise LocationError(
            f"checkpoint.location={location}: run_dir={run_dir} keeps its checkpoints in "
            f"{before}; set the location it was started with, or use a new run_dir"
        )
    if before is None and complete_checkpoints(run_dir):
        raise LocationError(
            f"checkpoint.location={location}: run_dir={run_dir} already has checkpoints in "
            f"{run_dir / CHECKPOINTS_DIR}; leave checkpoint.location empty, or use a new run_dir"
        )
    if first_rank and before is None:
        run_dir.mkdir(parents=True, exist_ok=True)
        # Written aside and renamed into place: the other ranks, reading it in their own
        # preflight meanwhile, find no file or the whole one, never an empty one being written.
        aside = run_dir / f".{CHECKPOINT_LOCATION_FILE}.{os.getpid()}"
        aside.write_text(prefix + "\n")
        os.replace(aside, run_dir / CHECKPOINT_LOCATION_FILE)
    return prefix


def check_location(location: str) -> None:
    """Raise LocationError unless ``location`` is an s3:// prefix whose bucket answers to the
    environment's credentials (metadata requests only: nothing is read or written)."""
    if not is_url(location) or refusal(location) is not None:
        raise LocationError(
            f"checkpoint.location={location}: give an s3://bucket/prefix (or leave it empty "
            "for RUN_DIR/checkpoints)"
        )
    try:
        check_bucket(location)
    except StorageError as error:
        raise LocationError(f"checkpoint.location: {error}") from None


def completed(run_dir: Path) -> dict[int, tuple[Ref, float]]:
    """The run's complete checkpoints by step: each one's place and its marker's time."""
    prefix = recorded(run_dir)
    if prefix is None:
        found = {}
        for step, path in complete_checkpoints(run_dir).items():
            try:
                found[step] = (path, (path / MARKER).stat().st_mtime)
            except OSError:  # pruned meanwhile
                continue
        return found
    steps: dict[int, tuple[Ref, float]] = {}
    for key, (_, modified) in listing(prefix).items():
        head, _, name = key.partition("/")
        match = STEP_DIR.fullmatch(head)
        if match and name == MARKER:
            steps[int(match.group(1))] = (join(prefix, head), modified)
    return dict(sorted(steps.items()))


def is_complete(checkpoint: Ref) -> bool:
    """Whether ``checkpoint`` holds its marker."""
    if isinstance(checkpoint, Path):
        return (checkpoint / MARKER).is_file()
    try:
        get_bytes(join(checkpoint, MARKER))
    except FileNotFoundError:
        return False
    return True


def newest_step(run_dir: Path) -> int | None:
    return max(completed(run_dir), default=None)


def read_state(checkpoint: Ref) -> dict:
    """A checkpoint's ``state.json`` (OSError, FileNotFoundError or ValueError if unreadable)."""
    if isinstance(checkpoint, Path):
        return json.loads((checkpoint / STATE_FILE).read_text())
    return json.loads(get_bytes(join(checkpoint, STATE_FILE)))


def newest_state(run_dir: Path) -> tuple[Ref, dict] | None:
    """The run's newest complete checkpoint and its state file (None: none, or one whose state
    cannot be read, which the loader judges itself)."""
    steps = completed(run_dir)
    if not steps:
        return None
    newest, _ = steps[max(steps)]
    try:
        state = read_state(newest)
    except (OSError, ValueError):
        return None
    return (newest, state) if isinstance(state, dict) else None
