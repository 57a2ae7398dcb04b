"""The repository, its command-line tools and Python modules run as a user runs them, and what
a test does on a machine that lacks something it needs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

import pytest

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]


def missing_capability(reason: str) -> NoReturn:
    """End a test that this machine cannot run (no mount rights, a daemon or a binary missing).

    Locally it is skipped, the reason in pytest's summary. Under CI (``CI=true``, set by
    .ci/run) it fails: a skip there would pass without checking anything, and the Makefile's
    setup targets are meant to provide everything the suite needs.
    """
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (under CI=true a missing capability fails the test)", pytrace=False)
    pytest.skip(reason)


def run_tool(
    tool: str, *args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / tool), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", **(env or {})},
        timeout=timeout,
    )


def run_into_closed_pipe(
    tool: str, *args: str, stderr_too: bool = False, env: dict | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``TOOL ARGS | head`` (``2>&1 | head`` with ``stderr_too``) whose reader is gone before the
    tool prints anything: the pipe's read end closed before the tool starts. Only stderr is
    captured, and not with ``stderr_too``: the closed pipe takes it."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [str(BIN / tool), *args],
            stdout=write,
            stderr=write if stderr_too else subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
            timeout=timeout,
        )
    finally:
        os.close(write)


def run_script(
    script: Path, *args: str, env: dict | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python SCRIPT ARGS`` from the repository root, as a user runs the repo's scripts,
    forked from the test process's zygote (tests/harness/zygote.py)."""
    from tests.harness.zygote import run_python

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    return run_python([str(script), *args], 1, env, timeout=timeout)


def run_module(
    module: str, *args: str, nproc: int = 1, cwd: Path = REPO
) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGS`` from ``cwd`` (the repository root unless given) on ``nproc``
    ranks, forked from the test process's zygote (tests/harness/zygote.py). The return code
    is the code of the rank that failed first."""
    from tests.harness.zygote import run_python

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return run_python(["-m", module, *args], nproc, env, cwd, timeout=300)


# What the checkout holds that is not a test's business: git's, the environment's, the caches.
NOT_WRITTEN_BY_TESTS = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache"}


def checkout_paths() -> set[str]:
    """Every file in the checkout (relative), less ``NOT_WRITTEN_BY_TESTS``: taken before and
    after a session, the difference is what tests wrote outside their temporary folders
    (``data/`` and ``runs/`` are ignored by git, so git cannot tell). Files only: an empty folder
    holds nothing a later run could read."""
    found = set()
    for folder, folders, files in os.walk(REPO):
        folders[:] = [
            name
            for name in folders
            if name not in NOT_WRITTEN_BY_TESTS and not name.endswith(".egg-info")
        ]
        here = Path(folder).relative_to(REPO)
        found.update(str(here / name) for name in files)
    return found
