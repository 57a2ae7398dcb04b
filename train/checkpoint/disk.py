"""The disk under the checkpoints: files written so that a crash leaves them whole, and the one
line a failed write, or a disk without room for the next checkpoint, gets.

That line names the problem, the disk and its free space, the path and the fix: ``no space
left on device on /mnt/runs (0 B free) writing PATH; free space or move the run dir``. Whether
a directory can be written at all is the run dir's rule (``contract.run_dir.not_writable``,
which ``orchestrator status`` also asks); this module only says which errno that means.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from contract.run_dir import not_writable, room_shortfall

# What a failed write means to the user, and what to do about it.
_DISK_PROBLEMS = {
    errno.ENOSPC: ("no space left on device", "free space or move the run dir"),
    errno.EDQUOT: ("disk quota exceeded", "free space or move the run dir"),
    errno.EROFS: ("read-only file system", "make it writable or move the run dir"),
    errno.EACCES: ("permission denied", "fix the permissions or move the run dir"),
    errno.EPERM: ("operation not permitted", "fix the permissions or move the run dir"),
}
_PROBE_BYTES = 1 << 16  # written and fsynced at start: a full or read-only disk refuses it


def write_durably(path: Path, data: str | bytes) -> None:
    """``data`` (text or bytes) into ``path``, on the disk before this returns."""
    with open(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """The entries of directory ``path`` (files created or renamed in it) on the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def _mount_point(path: Path) -> Path:
    path = _existing(path).resolve()
    while not os.path.ismount(path):
        path = path.parent
    return path


def _size(nbytes: float) -> str:
    """``0 B``, ``12.3 KiB``, ``4.8 MiB``, ``1.2 GiB``."""
    if nbytes < 1024:
        return f"{nbytes:.0f} B"
    for unit in ("KiB", "MiB"):
        nbytes /= 1024
        if nbytes < 1024:
            return f"{nbytes:.1f} {unit}"
    return f"{nbytes / 1024:.1f} GiB"


def _disk(path: Path) -> str:
    """The file system that holds ``path``, with its free space: ``/mnt/runs (0 B free)``."""
    free = shutil.disk_usage(_existing(path)).free
    return f"{_mount_point(path)} ({_size(free)} free)"


def _find_os_error(exc: BaseException | None) -> OSError | None:
    """The OSError behind a failed write: itself, its cause, or one a DCP rank reported."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError):
            return exc
        if isinstance(exc, CheckpointException):
            for failure, _ in exc.failures.values():
                found = _find_os_error(failure)
                if found is not None:
                    return found
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def _disk_errno(where: Path) -> int | None:
    """The errno a write under ``where`` would meet now: read-only, not writable, or full."""
    directory = _existing(where)
    if not_writable(directory):  # the run dir's rule; which of its two cases is the errno
        return errno.EROFS if os.statvfs(directory).f_flag & os.ST_RDONLY else errno.EACCES
    if shutil.disk_usage(directory).free < _PROBE_BYTES:
        return errno.ENOSPC
    return None


def describe(exc: BaseException, where: Path) -> dict:
    """A failed write under ``where``, small enough to gather: its errno, the path and a
    one-line reason. torch.save's zip writer turns a failed write into a RuntimeError without
    the errno ("unexpected pos"), so the disk itself is asked when no OSError is found."""
    os_error = _find_os_error(exc)
    if os_error is not None:
        return {
            "errno": os_error.errno,
            "path": None if os_error.filename is None else str(os_error.filename),
            "reason": os_error.strerror or str(os_error),
        }
    reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else repr(exc)
    return {"errno": _disk_errno(where), "path": None, "reason": reason}


def failure_text(failure: dict, where: Path, path: Path) -> str:
    """What went wrong with a write under ``where`` (``describe``'s ``failure``; ``path``: the
    file it wrote, if the error did not name one), on which disk, and the fix."""
    problem, fix = _DISK_PROBLEMS.get(failure["errno"], (failure["reason"], None))
    return (
        f"{problem} on {_disk(where)} writing {failure['path'] or path}; "
        f"{fix or 'check the disk or move the run dir'}"
    )


def room_problem(directory: Path) -> str | None:
    """Why no checkpoint can be saved in ``directory`` now (one line), or None: a probe file
    is written and fsynced (a full or read-only disk refuses it), then the free space is
    measured against the newest checkpoint."""
    probe = directory / f".probe-{uuid.uuid4().hex[:12]}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"\0" * _PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as exc:
        failure = describe(exc, directory)
        with contextlib.suppress(OSError):  # a read-only disk refuses even this
            probe.unlink(missing_ok=True)
        return f"checkpoints cannot be saved: {failure_text(failure, directory, probe)}"
    shortfall = room_shortfall(directory)
    if shortfall is None:
        return None
    free, needed, newest = shortfall
    return (
        f"checkpoints cannot be saved: {_size(free)} free on {_mount_point(directory)}, "
        f"the last checkpoint {newest.name} took {_size(needed)}, in {directory}; "
        "free space or move the run dir"
    )
