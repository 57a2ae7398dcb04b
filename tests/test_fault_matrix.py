"""The fault matrix's training rows on the loopback cluster: a rank killed mid-step, and scancel
in the middle of writing checkpoints. Each asserts what every row of docs/faults.md promises:
the chain reaches max_steps with no user action, at most one checkpoint interval of steps is
lost, only complete checkpoints are loaded, and the manifest and status say what happened.

The other rows live beside the code they exercise: a dead slurmd or slurmctld
(tests/test_cluster_faults.py), a full or read-only disk and non-finite weights
(tests/test_checkpoint.py), a diverging run and a clean scancel (tests/test_self_healing.py),
a hung rank (tests/test_hang.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import REPO, chain_status, launch_json, run_tool, wait_chain
from tests.test_trainer import metrics

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

RESUMED = re.compile(r"resumed from (\S+) at step (\d+)")


def launch(run_dir: Path, corpus: Path, jobs: int, *overrides: str, retries: int = 0) -> dict:
    return launch_json(
        f"-n{jobs}",
        "--retries",
        str(retries),
        "--run-dir",
        str(run_dir),
        "recipes/train_tiny_fsdp2.yaml",
        "--",
        f"data.corpus={corpus}",
        "data.max_duration=8",
        "wandb.mode=offline",
        *overrides,
        cwd=REPO,
    )


def wait_until(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def training_rank(run_dir: Path) -> psutil.Process | None:
    """A rank of the run (a child of torchrun), not torchrun itself."""
    for process in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if f"run_dir={run_dir}" not in cmdline or "torchrun" in cmdline:
            continue
        parent = process.parent()
        if "-m train" in cmdline and parent and "torchrun" in " ".join(parent.cmdline()):
            return process
    return None


def job_state(chain_id: str, index: int) -> str:
    return chain_status(chain_id)["jobs"][index]["state"]


def resumed_checkpoints(chain_id: str) -> list[tuple[Path, int]]:
    logs = run_tool("orchestrator", "logs", chain_id).stdout
    return [(Path(path), int(step)) for path, step in RESUMED.findall(logs)]


def assert_only_complete_checkpoints_loaded(chain_id: str) -> list[int]:
    loaded = resumed_checkpoints(chain_id)
    for path, step in loaded:
        assert path.name == f"step_{step}" and (path / "COMPLETE").is_file(), path
    return [step for _, step in loaded]


def test_a_rank_killed_mid_step_ends_the_job_in_seconds_and_the_chain_finishes(
    slurm_cluster, tmp_path, corpus
):
    run_dir = tmp_path / "run"
    summary = launch(
        run_dir,
        corpus,
        2,
        "train.max_steps=16",
        "checkpoint.interval=4",
        "checkpoint.keep=10",  # every loaded checkpoint is still there to inspect
        retries=1,
    )
    chain = summary["chain_id"]
    wait_until(lambda: any(row["step"] >= 6 for row in metrics_or_none(run_dir)), 300, "step 6")
    victim = wait_until(lambda: training_rank(run_dir), 30, "a rank of job 0")
    killed = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    wait_until(lambda: job_state(chain, 0) not in ("RUNNING", "COMPLETING"), 60, "job 0 to end")
    assert time.monotonic() - killed < 30, "job 0 outlived its killed rank"

    final = wait_chain(chain, timeout=400)
    states = [job["state"] for job in final["jobs"]]
    assert states[:2] == ["FAILED", "COMPLETED"], final
    rows = metrics(run_dir)
    assert rows[-1]["step"] == 16
    last_of_job0 = max(row["step"] for row in rows if row["job_index"] == 0)
    (resumed,) = assert_only_complete_checkpoints_loaded(chain)
    assert resumed % 4 == 0 and last_of_job0 - resumed <= 4, (last_of_job0, resumed)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["jobs"][0]["outcome"] == "failed"
    # The replacement queued for job 0 was cancelled unstarted once job 1 finished training.
    (replacement,) = [job for job in manifest["jobs"] if job.get("replaces") == 0]
    assert replacement["outcome"] == "not_started" and manifest["status"] == "complete"
    status = run_tool("orchestrator", "status", chain).stdout
    assert "failed" in status and "replaces job 0" in status, status


def test_scancel_while_checkpoints_are_written_never_loads_a_torn_one(
    slurm_cluster, tmp_path, corpus
):
    """Jobs 0-2 are each cancelled while a checkpoint is being written, at a different moment
    of the write (at once, 0.3 s and 1 s in); job 3 finishes. The small preset makes each
    checkpoint about 70 MiB, so a write takes long enough to land in."""
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    summary = launch(
        run_dir,
        corpus,
        4,
        "model.preset=small",
        "train.max_steps=12",
        "checkpoint.interval=2",
        "checkpoint.keep=10",
    )
    chain = summary["chain_id"]
    ids = [job["job_id"] for job in summary["jobs"]]
    for index, delay in enumerate((0.0, 0.3, 1.0)):
        seen = {path.name for path in checkpoints.glob(".tmp-step_*")}
        wait_until(
            lambda seen=seen: {p.name for p in checkpoints.glob(".tmp-step_*")} - seen,
            400,
            f"job {index} to start writing a checkpoint",
        )
        time.sleep(delay)
        subprocess.run(["scancel", str(ids[index])], check=True)
        wait_until(
            lambda index=index: job_state(chain, index) not in ("RUNNING", "COMPLETING"),
            60,
            f"job {index} to end",
        )
    final = wait_chain(chain, timeout=600)
    assert [job["state"] for job in final["jobs"]] == ["CANCELLED"] * 3 + ["COMPLETED"], final
    rows = metrics(run_dir)
    assert rows[-1]["step"] == 12
    for index in range(3):
        steps = [row["step"] for row in rows if row["job_index"] == index]
        if steps:
            later = [row["step"] for row in rows if row["job_index"] > index]
            assert not later or min(later) - 1 >= max(steps) - 2, "more than an interval lost"
    loaded = assert_only_complete_checkpoints_loaded(chain)
    assert len(loaded) == 3, loaded
    assert not list(checkpoints.glob(".tmp-step_*")), "a torn checkpoint was left behind"


def metrics_or_none(run_dir: Path) -> list[dict]:
    return metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
