"""Where a run's checkpoints live, behind the one interface ``CheckpointManager`` uses: a
directory on the run dir's file system (``RUN_DIR/checkpoints``, the default) or a prefix in
object storage (``checkpoint.location=s3://bucket/prefix``, ``train.checkpoint.location``).

A save writes a step's files into a place of its own (``begin``), then ``finish`` makes it
complete: the state file, then the marker, last. On disk the files go into a ``.tmp-*``
directory that is renamed once marked, so a ``step_<N>`` directory is always whole. Object
storage has no rename: the objects go under ``step_<N>/`` directly and the ``COMPLETE`` object,
written after every other object of the save, is what makes it complete; a prefix without it is
torn, whatever it holds, and is never loaded. A checkpoint that failed to load is set aside: a
renamed directory on disk, a ``BROKEN`` marker in place of ``COMPLETE`` in a bucket (kept for a
look, never loaded, never removed as torn).
"""

from __future__ import annotations

import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from contract.run_dir import (
    CHECKPOINTS_DIR,
    MARKER,
    STATE_FILE,
    STEP_DIR,
    TMP_DIR,
    scan_checkpoints,
    step_name,
    tmp_step_name,
)
from train.checkpoint.disk import describe, failure_text, fsync_dir, room_problem, write_durably
from train.checkpoint.location import Ref, checkpoint_name, recorded
from train.checkpoint.object_store import S3StorageReader, S3StorageWriter
from train.data.storage import (
    StorageError,
    check_bucket,
    delete_prefix,
    describe_error,
    get_bytes,
    join,
    listing,
    put_bytes,
)

TRASH_PREFIX = ".trash-"
BROKEN = "BROKEN"  # in object storage: the marker of a checkpoint set aside


class Place(ABC):
    """The checkpoints of one run, wherever they live."""

    where: str  # the directory or the prefix, as messages name it

    @abstractmethod
    def scan(self) -> tuple[dict[int, Ref], list[tuple[int, Ref]]]:
        """Complete checkpoints by step, and the torn entries (no marker; saves in progress)."""

    @abstractmethod
    def final(self, step: int) -> Ref:
        """Where checkpoint ``step`` is once complete."""

    @abstractmethod
    def begin(self, step: int) -> Ref | None:
        """Rank 0: where the files of a save of ``step`` go; None when ``step`` already has a
        complete checkpoint. Raises OSError or StorageError."""

    @abstractmethod
    def writer(self, ref: Ref, background: bool) -> StorageWriter:
        """DCP's writer into ``ref`` (``background``: the state is already a host copy)."""

    @abstractmethod
    def reader(self, ref: Ref) -> StorageReader: ...

    @abstractmethod
    def put(self, ref: Ref, name: str, data: bytes) -> None:
        """A file of the save in ``ref`` (``rng/rank_00000.pt``), durable when this returns."""

    @abstractmethod
    def get(self, ref: Ref, name: str) -> bytes:
        """A file of checkpoint ``ref`` (FileNotFoundError when it has none)."""

    @abstractmethod
    def finish(self, ref: Ref, step: int, state_json: str, marker: str) -> Ref:
        """Rank 0: the state file, then the marker: the save in ``ref`` is complete; its final
        name. Raises OSError or StorageError."""

    @abstractmethod
    def discard(self, ref: Ref) -> None:
        """Remove a save that failed (every rank has given up on it)."""

    @abstractmethod
    def doom(self, refs: list[Ref]) -> Callable[[], None] | None:
        """Take ``refs`` out of the checkpoints now (fast); the slow removal to run in the
        background, if any."""

    @abstractmethod
    def leftovers(self) -> list[Ref]:
        """What crashed jobs left (torn saves, pruning not finished): removed at a job's start."""

    @abstractmethod
    def set_aside(self, ref: Ref) -> str:
        """Keep a complete checkpoint that failed to load from ever loading again; its new name."""

    @abstractmethod
    def room_problem(self) -> str | None:
        """Why no checkpoint can be saved here now (one line), or None."""

    @abstractmethod
    def describe(self, error: BaseException, ref: Ref) -> dict:
        """A failed write, small enough to gather (``train.checkpoint.disk.describe``'s form)."""

    @abstractmethod
    def failure_text(self, failure: dict, ref: Ref) -> str:
        """``describe``'s failure as the part of a line after ``not saved: ``."""

    @staticmethod
    def name(ref: Ref) -> str:
        return checkpoint_name(ref)


class DirectoryPlace(Place):
    """``RUN_DIR/checkpoints`` (see ``train.checkpoint.manager`` for the layout)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.where = str(self.directory)

    def scan(self) -> tuple[dict[int, Ref], list[tuple[int, Ref]]]:
        complete, torn = scan_checkpoints(self.directory)
        return dict(complete), list(torn)

    def final(self, step: int) -> Ref:
        return self.directory / step_name(step)

    def begin(self, step: int) -> Ref | None:
        if (self.final(step) / MARKER).is_file():
            return None
        tmp = self.directory / tmp_step_name(step, uuid.uuid4().hex[:12])
        tmp.mkdir(parents=True)
        return tmp

    def writer(self, ref: Ref, background: bool) -> StorageWriter:
        # A background write's copy is already on the host: no side stream to copy it ahead
        # with (DCP's default on a CUDA machine), whose syncs CUDA's sync debug mode would count
        # against the step that runs meanwhile.
        if background:
            return FileSystemWriter(ref, per_thread_copy_ahead=0)
        return FileSystemWriter(ref)

    def reader(self, ref: Ref) -> StorageReader:
        return FileSystemReader(ref)

    def put(self, ref: Ref, name: str, data: bytes) -> None:
        path = Path(ref) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        write_durably(path, data)
        fsync_dir(path.parent)

    def get(self, ref: Ref, name: str) -> bytes:
        return (Path(ref) / name).read_bytes()

    def finish(self, ref: Ref, step: int, state_json: str, marker: str) -> Ref:
        tmp, final = Path(ref), Path(self.final(step))
        write_durably(tmp / STATE_FILE, state_json)
        fsync_dir(tmp)
        write_durably(tmp / MARKER, marker)
        if final.exists():
            shutil.rmtree(final)  # torn: its step had no marker
        tmp.rename(final)
        fsync_dir(self.directory)
        return final

    def discard(self, ref: Ref) -> None:
        shutil.rmtree(ref, ignore_errors=True)

    def doom(self, refs: list[Ref]) -> Callable[[], None] | None:
        trash = []
        for path in map(Path, refs):
            target = path.with_name(f"{TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:12]}")
            try:
                path.rename(target)
            except OSError:
                continue
            trash.append(target)
        return (lambda: _remove_all(trash)) if trash else None

    def leftovers(self) -> list[Ref]:
        if not self.directory.is_dir():
            return []
        return [
            entry
            for entry in sorted(self.directory.iterdir())
            if TMP_DIR.fullmatch(entry.name) or entry.name.startswith(TRASH_PREFIX)
        ]

    def set_aside(self, ref: Ref) -> str:
        path = Path(ref)
        aside = path.with_name(f"{path.name}.broken-{uuid.uuid4().hex[:12]}")
        path.rename(aside)
        return aside.name

    def room_problem(self) -> str | None:
        return room_problem(self.directory)

    def describe(self, error: BaseException, ref: Ref) -> dict:
        return describe(error, Path(ref))

    def failure_text(self, failure: dict, ref: Ref) -> str:
        return failure_text(failure, Path(ref), Path(ref))


def _remove_all(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


class ObjectPlace(Place):
    """A prefix in an S3 bucket: ``<prefix>/step_<N>/`` holds a save's objects (the DCP files,
    ``rng/rank_<r>.pt``, ``state.json``) and, once complete, ``COMPLETE``."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix.rstrip("/")
        self.where = self.prefix

    def _steps(self) -> dict[int, set[str]]:
        """Each step prefix's object names (relative to it)."""
        steps: dict[int, set[str]] = {}
        for key in listing(self.prefix):
            head, _, rest = key.partition("/")
            match = STEP_DIR.fullmatch(head)
            if match and rest:
                steps.setdefault(int(match.group(1)), set()).add(rest)
        return steps

    def scan(self) -> tuple[dict[int, Ref], list[tuple[int, Ref]]]:
        complete: dict[int, Ref] = {}
        torn: list[tuple[int, Ref]] = []
        for step, names in sorted(self._steps().items()):
            ref = self.final(step)
            if MARKER in names:
                complete[step] = ref
            elif BROKEN not in names:
                torn.append((step, ref))
        return complete, torn

    def final(self, step: int) -> Ref:
        return join(self.prefix, step_name(step))

    def begin(self, step: int) -> Ref | None:
        ref = self.final(step)
        names = set(listing(ref))
        if MARKER in names:
            return None
        if names:  # torn by a crash, or set aside: its objects would mix with the new save's
            delete_prefix(ref)
        return ref

    def writer(self, ref: Ref, background: bool) -> StorageWriter:
        return S3StorageWriter(str(ref), per_thread_copy_ahead=0)

    def reader(self, ref: Ref) -> StorageReader:
        return S3StorageReader(str(ref))

    def put(self, ref: Ref, name: str, data: bytes) -> None:
        put_bytes(join(str(ref), name), data)

    def get(self, ref: Ref, name: str) -> bytes:
        return get_bytes(join(str(ref), name))

    def finish(self, ref: Ref, step: int, state_json: str, marker: str) -> Ref:
        put_bytes(join(str(ref), STATE_FILE), state_json.encode())
        put_bytes(join(str(ref), MARKER), marker.encode())
        return ref

    def discard(self, ref: Ref) -> None:
        delete_prefix(str(ref))

    def doom(self, refs: list[Ref]) -> Callable[[], None] | None:
        # The marker first: from this moment none of them is complete, whatever the rest takes.
        for ref in refs:
            delete_prefix(join(str(ref), MARKER))
        return (lambda: [delete_prefix(str(ref)) for ref in refs]) if refs else None

    def leftovers(self) -> list[Ref]:
        return [ref for _, ref in self.scan()[1]]

    def set_aside(self, ref: Ref) -> str:
        put_bytes(join(str(ref), BROKEN), get_bytes(join(str(ref), MARKER)))
        delete_prefix(join(str(ref), MARKER))
        return f"{self.name(ref)} (marked {BROKEN})"

    def room_problem(self) -> str | None:
        try:
            check_bucket(self.prefix)
        except StorageError as error:
            return f"checkpoints cannot be saved: {error}"
        return None

    def describe(self, error: BaseException, ref: Ref) -> dict:
        return {"errno": None, "path": str(ref), "reason": describe_error(error, str(ref))}

    def failure_text(self, failure: dict, ref: Ref) -> str:
        return failure["reason"]


def place_of(run_dir: Path) -> Place:
    """Where ``run_dir``'s checkpoints are (``train.checkpoint.location``)."""
    prefix = recorded(run_dir)
    if prefix is None:
        return DirectoryPlace(Path(run_dir) / CHECKPOINTS_DIR)
    return ObjectPlace(prefix)
