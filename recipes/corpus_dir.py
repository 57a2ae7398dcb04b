"""A corpus directory is built whole or not at all: the contract both corpus scripts keep.

The corpus is built in a temporary sibling directory, its ``COMPLETE.json`` (the settings and a
summary) is written last, and the directory is renamed into place, so an interrupted run never
leaves output that looks complete. A rerun over a complete corpus made with the same settings
does nothing; other settings, or an unfinished directory, are refused with one error line.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from orchestrator.errors import UsageError

MARKER = "COMPLETE.json"


def completed(out: Path, settings: dict) -> dict | None:
    """The summary of the complete corpus at ``out`` made with ``settings``; None when ``out``
    does not exist. Raises UsageError for other settings or an unfinished directory."""
    marker = out / MARKER
    if marker.exists():
        done = json.loads(marker.read_text())
        if done["settings"] != settings:
            raise UsageError(
                f"{out} holds a corpus made with {done['settings']}, not {settings}: "
                f"pass another --out or delete {out}"
            )
        return done
    if out.exists():
        raise UsageError(
            f"{out} exists but is not a complete corpus: delete it or pick another --out"
        )
    return None


def build_whole(
    out: Path, settings: dict, build: Callable[[Path], dict], tool: str
) -> tuple[dict, bool]:
    """Run ``build(tmp)`` in a temporary sibling of ``out``, mark it complete, rename it into
    place. Returns the summary, and False if another run completed ``out`` first (its summary
    is kept)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the corpus is meant to be shared
    try:
        summary = {"settings": settings, **build(tmp)}
        (tmp / MARKER).write_text(json.dumps(summary, indent=2) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / MARKER).exists():
            raise
        print(f"{tool}: another run completed {out} first; keeping it", flush=True)
        return json.loads((out / MARKER).read_text()), False
    return summary, True
