"""Small real file systems to fill up, for the tests of a full disk."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.harness.process import missing_capability


def fill_disk(disk: Path, leave: int) -> Path:
    """A file that leaves about ``leave`` bytes of ``disk`` free."""
    filler = disk / "filler"
    with open(filler, "wb") as f:
        while (free := shutil.disk_usage(disk).free) > leave:
            try:
                f.write(b"\0" * min(free - leave, 1 << 20))
                f.flush()
            except OSError:
                break
    return filler


@contextmanager
def tmpfs(disk: Path, size: str) -> Iterator[Path]:
    """A real file system of ``size`` (tmpfs) at ``disk`` for the block; where mounting is not
    allowed (not root), a missing capability."""
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        missing_capability(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)
