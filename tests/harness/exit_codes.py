"""The one table of exit codes (docs/local_and_cluster.md, "Exit codes") as the tests read it,
a SLURM that refuses every submission (the scheduler's failure without a cluster), and Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from orchestrator.slurm.partitions import PARTITION_FORMAT
from tests.harness.process import REPO

EXIT_CODES_DOC = REPO / "docs" / "local_and_cluster.md"
EXIT_CODES_HEADING = "## Exit codes"
# What sbatch says to a job of an account the cluster does not know; it is not worth a retry.
SBATCH_REFUSAL = "sbatch: error: Batch job submission failed: Invalid account"


def exit_code_table() -> dict[int, dict[str, str]]:
    """The table under the heading, by code: each row as {column heading: cell}."""
    section = EXIT_CODES_DOC.read_text().split(f"\n{EXIT_CODES_HEADING}\n", 1)[1]
    lines = [line for line in section.split("\n## ", 1)[0].splitlines() if line.startswith("|")]
    header, rows = cells(lines[0]), [cells(line) for line in lines[2:]]
    return {int(row[0]): dict(zip(header, row, strict=True)) for row in rows}


def cells(line: str) -> list[str]:
    """A markdown table row's cells (``\\|`` is a pipe inside a cell)."""
    parts = line.strip().strip("|").replace("\\|", "\0").split("|")
    return [part.strip().replace("\0", "|") for part in parts]


def refusing_slurm(bin_dir: Path) -> dict[str, str]:
    """The environment of a machine whose sinfo answers (one partition of two 4-CPU nodes) and
    whose sbatch refuses every job; the real SLURM commands are not reached."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    fields = {
        "%P": "debug*",
        "%a": "up",
        "%D": "2",
        "%c": "4",
        "%G": "(null)",
        "%l": "infinite",
        "%m": "1",
    }
    partition = "|".join(fields[field] for field in PARTITION_FORMAT.split("|"))
    scripts = {
        "sinfo": f"#!/bin/sh\necho '{partition}'\n",
        "sbatch": f"#!/bin/sh\necho '{SBATCH_REFUSAL}' >&2\nexit 1\n",
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def interrupted_when(
    argv: list[str], started: Path, cwd: Path, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` and press Ctrl-C (SIGINT) once ``started`` exists, as a user at a terminal
    does to a command that is running. SIGINT is restored to its default for the command: a
    suite started in the background ignores it, and so would the command."""
    process = subprocess.Popen(
        argv,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + timeout
        while not started.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)
