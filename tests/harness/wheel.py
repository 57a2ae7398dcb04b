"""The toolkit as a wheel: built from a copy of the working tree, as a user's ``pip`` builds it.

Shared by the wheel test (a fresh environment with torch) and the SSH launch test (the toolkit a
second Unix user runs on the "login node").
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.harness.process import REPO, missing_capability

OFFLINE = {"PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def run(argv: list[str | Path], cwd: Path, env: dict[str, str] | None = None) -> str:
    """``argv``'s stdout; any failure ends the test with its output."""
    completed = subprocess.run(
        [str(word) for word in argv],
        cwd=cwd,
        env={**os.environ, **OFFLINE} if env is None else env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, f"{argv}:\n{completed.stdout}\n{completed.stderr}"
    return completed.stdout


def wheelhouse() -> Path:
    """``make setup``'s wheelhouse for the environment that runs the tests."""
    where = run(["make", "-s", "-C", REPO, f"VENV={sys.prefix}", "print-WHEELHOUSE"], REPO)
    found = Path(where.strip())
    if not (found / ".complete").is_file():
        missing_capability(f"no wheelhouse at {found}: run make setup")
    return found


def build_wheel(root: Path) -> Path:
    """The project's wheel, built in ``root`` from a copy of the tracked and unignored files
    (so nothing git ignores, a venv or a run dir, can slip into it)."""
    source = root / "source"
    files = run(["git", "ls-files", "-z", "-co", "--exclude-standard"], REPO).split("\0")
    for name in filter(None, files):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
         root / "dist", source], root)  # fmt: skip
    [wheel] = (root / "dist").glob("*.whl")
    return wheel
