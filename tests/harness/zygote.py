"""``python -m MODULE ARGS`` or ``python SCRIPT ARGS`` on N ranks, forked from a process that
has imported the trainer (tests/harness/workers/rank_zygote.py) instead of started fresh: the
same ranks, rendezvous and exit codes, without ~7 CPU-seconds of imports per rank and ~3 for
torchrun.

One zygote serves each test process, started on its first command and stopped when the process
exits. A command whose environment differs from the zygote's in a variable that torch,
transformers or Python read as they import (``IMPORT_TIME_PREFIXES``) runs as a fresh process
instead, with torchrun for several ranks: what a fork would inherit is not what it asked for.

The result is a ``CompletedProcess`` as ``subprocess.run`` gives it, except that with several
ranks its return code is the code of the rank that failed first (torchrun's own is 1, the
ranks' codes only in its report), which is what the chain's hook reads from srun too.
"""

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

from tests.harness.process import REPO

# Variables read when the interpreter, torch or transformers start, not when a rank runs.
IMPORT_TIME_PREFIXES = (
    "PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL_", "CUDA", "HF_", "TRANSFORMERS", "LD_",
)  # fmt: skip


class Zygote:
    """The zygote process of this test process and the environment it was started with."""

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
        self.read(timeout=300)  # {"ready": true}: the imports done

    def serves(self, env: dict[str, str]) -> bool:
        changed = {key for key, _ in set(env.items()) ^ set(self.env.items())}
        if env.get("PYTHONPATH") == str(REPO):  # the zygote's sys.path starts with the checkout
            changed.discard("PYTHONPATH")
        return not any(key.startswith(IMPORT_TIME_PREFIXES) for key in changed)

    def read(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError
        line = self.process.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"the rank zygote exited ({self.process.wait()})")
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
            pids = self.read(timeout)["pids"]
            command = [sys.executable, *argv]
            try:
                done = self.read(max(deadline - time.monotonic(), 0))
            except TimeoutError:
                for pid in pids:
                    kill_session(pid)
                self.read(timeout=60)
                raise subprocess.TimeoutExpired(command, timeout, read(out), read(err)) from None
            code = 0 if done["first"] is None else done["codes"][done["first"]]
            return subprocess.CompletedProcess(command, code, read(out), read(err))

    def stop(self) -> None:
        self.process.stdin.close()  # type: ignore[union-attr]
        self.process.wait(timeout=30)


def kill_session(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


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
        _zygote = Zygote({**os.environ, "OMP_NUM_THREADS": "1"})
        atexit.register(_zygote.stop)
    if _zygote.serves(env):
        return _zygote.run(argv, nproc, env, cwd, timeout)
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return subprocess.run(
        [*launcher, *argv], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout
    )
