"""The repository, its command-line tools and Python modules run as a user runs them (Python's
forked from a zygote that imported the trainer once), and what a test does on a machine that
lacks something it needs."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
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


# Variables read when the interpreter, torch or transformers start, not when a rank runs.
IMPORT_TIME_PREFIXES = (
    "PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL_", "CUDA", "HF_", "TRANSFORMERS", "LD_",
)  # fmt: skip
# ... except these, which torch sets in the test process itself (inductor's cache folder, the
# first time a test compiles in-process) and reads only when it uses them: a rank forked with
# the command's environment sees the command's value. Counted as changed, each would have sent
# every later command of that test process to fresh interpreters (and torchrun's own exit codes).
READ_AT_USE = ("TORCHINDUCTOR_CACHE_DIR",)


def imports_alike(started: dict[str, str], env: dict[str, str]) -> bool:
    """Whether a process started with ``env`` imports as one started with ``started`` did."""
    changed = {key for key, _ in set(env.items()) ^ set(started.items())}
    if env.get("PYTHONPATH") == str(REPO):  # the zygote's sys.path starts with the checkout
        changed.discard("PYTHONPATH")
    return not any(
        key.startswith(IMPORT_TIME_PREFIXES) and key not in READ_AT_USE for key in changed
    )


class Zygote:
    """A process that has imported the trainer and forks the ranks of each command
    (tests/harness/workers/rank_zygote.py), with the environment it was started with.

    One serves each test process, started on its first command and stopped when the process
    exits: the same ranks, rendezvous and exit codes as fresh processes, without ~7 CPU-seconds
    of imports per rank and ~3 for torchrun. A command whose environment differs from the
    zygote's in a variable read at import (``IMPORT_TIME_PREFIXES``) starts fresh instead."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.harness.workers.rank_zygote"],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lock = threading.Lock()
        self.unread = b""  # the zygote's answers read from its pipe, not yet taken
        self.read(timeout=300)  # {"ready": true}: the imports done

    def serves(self, env: dict[str, str]) -> bool:
        return imports_alike(self.env, env)

    def read(self, timeout: float) -> dict:
        """The zygote's next answer; read from the pipe's descriptor, as select sees it (a
        buffered reader could hold the next answer where select cannot see it)."""
        deadline = time.monotonic() + timeout
        fd = self.process.stdout.fileno()  # type: ignore[union-attr]
        while b"\n" not in self.unread:
            ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
            if not ready:
                raise TimeoutError
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise RuntimeError(f"the rank zygote exited ({self.process.wait()})")
            self.unread += chunk
        line, self.unread = self.unread.split(b"\n", 1)
        return json.loads(line)

    def run(
        self, argv: list[str], nproc: int, env: dict[str, str], cwd: Path, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        with self.lock, tempfile.TemporaryDirectory(prefix="ranks-") as outputs:
            out, err = Path(outputs, "stdout"), Path(outputs, "stderr")
            request = {
                "argv": argv, "nproc": nproc, "env": env, "cwd": str(cwd),
                "stdout": str(out), "stderr": str(err),
            }  # fmt: skip
            self.process.stdin.write(json.dumps(request) + "\n")  # type: ignore[union-attr]
            self.process.stdin.flush()  # type: ignore[union-attr]
            deadline = time.monotonic() + timeout
            command = [sys.executable, *argv]
            pids: list[int] = []
            try:
                pids = self.read(timeout)["pids"]
                done = self.read(max(deadline - time.monotonic(), 0))
            except BaseException as error:  # a timeout, or the test stopped (pytest-timeout)
                self.abandon(pids)
                if isinstance(error, TimeoutError):
                    output = read(out), read(err)
                    raise subprocess.TimeoutExpired(command, timeout, *output) from None
                raise
            code = 0 if done["first"] is None else done["codes"][done["first"]]
            return subprocess.CompletedProcess(command, code, read(out), read(err))

    def abandon(self, pids: list[int]) -> None:
        """Kill a command's ranks and the zygote itself, whose answers to that command would
        otherwise be read as the next one's: the next command starts a new zygote."""
        for pid in pids:
            kill_session(pid)
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        self.process.stdin.close()  # type: ignore[union-attr]
        self.process.wait(timeout=30)


def kill_session(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL to a launcher and every process below it, waited for: torchrun starts its
    workers in sessions of their own, which a kill of its group alone would leave training on
    as orphans."""
    import psutil

    tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(True)]
    for member in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    psutil.wait_procs(tree, timeout=30)
    process.wait()


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


_zygote: Zygote | None = None


def run_python(
    argv: list[str], nproc: int, env: dict[str, str], cwd: Path = REPO, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """``python ARGV`` (``-m MODULE ARGS`` or ``SCRIPT ARGS``) on ``nproc`` ranks (one: no
    process group) with exactly ``env``, forked from this process's zygote where it can serve
    ``env``, else as fresh processes (torchrun for several ranks)."""
    global _zygote
    if _zygote is None or _zygote.process.poll() is not None:
        if _zygote is None:
            atexit.register(lambda: _zygote.stop())  # whichever zygote is current at exit
        _zygote = Zygote({**os.environ, "OMP_NUM_THREADS": "1"})
    if _zygote.serves(env):
        return _zygote.run(argv, nproc, env, cwd, timeout)
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return subprocess.run(
        [*launcher, *argv], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout
    )


def run_script(
    script: Path, *args: str, env: dict | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python SCRIPT ARGS`` from the repository root, as a user runs the repo's scripts,
    forked from the test process's zygote (``run_python``)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    return run_python([str(script), *args], 1, env, timeout=timeout)


def run_bash(
    script: Path, *args: str, env: dict | None = None, timeout: float = 900
) -> subprocess.CompletedProcess[str]:
    """``bash SCRIPT ARGS``, as a user runs the repo's shell scripts (the GPU scripts)."""
    return subprocess.run(
        ["bash", str(script), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )


def run_module(
    module: str, *args: str, nproc: int = 1, cwd: Path = REPO
) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGS`` from ``cwd`` (the repository root unless given) on ``nproc``
    ranks, forked from the test process's zygote (``run_python``). The return code is the
    code of the rank that failed first."""
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
