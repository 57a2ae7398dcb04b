"""A rank that stops mid-training (SIGSTOP: it cannot act, its peer waits in a collective) ends
the job within ``train.hang_timeout_s`` with exit code 5, not at the job's time limit; a stop
signal shortens the wait; and the chain's next job resumes from the last checkpoint."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import psutil
import pytest

from tests.helpers import FINISHED, REPO, chain_status, run_tool, wait_chain
from tests.test_trainer import launch_training, metrics, metrics_or_empty, train
from train.watchdog import SIGNAL_PATIENCE_S

TORCHRUN_KILL_S = 30  # torchrun SIGKILLs a rank that its SIGTERM did not end after this long
MARGIN_S = 30  # polling, teardown and a loaded 2-core machine
HUNG_LINE = "error: rank 0: the job is hung"


def wait_for_step(run_dir: Path, step: int, still_running=lambda: True, timeout: float = 240):
    """Wait until rank 0 has logged ``step``."""
    deadline = time.monotonic() + timeout
    while not any(row.get("step", 0) >= step for row in metrics_or_empty(run_dir)):
        assert still_running(), "the training ended before the rank could be stopped"
        assert time.monotonic() < deadline, f"no step {step} after {timeout} s"
        time.sleep(0.5)


def rank_processes(torchrun: int) -> dict[int, psutil.Process]:
    """torchrun's workers by rank (their RANK environment variable)."""
    return {int(child.environ()["RANK"]): child for child in psutil.Process(torchrun).children()}


def job_ranks(chain: str, job_index: int, rank: int) -> list[psutil.Process]:
    """The training processes of one rank of one job of a chain on this machine."""
    found = []
    for process in psutil.process_iter():
        with suppress(psutil.Error):  # gone meanwhile, or not ours to read
            env = process.environ()
            if (
                process.cmdline()[1:3] == ["-m", "train"]
                and env.get("ORCH_CHAIN_ID") == chain
                and env.get("ORCH_JOB_INDEX") == str(job_index)
                and env.get("RANK") == str(rank)
            ):
                found.append(process)
    return found


def test_a_negative_hang_timeout_is_refused(tmp_path, corpus):
    completed = train(tmp_path / "run", corpus, "train.hang_timeout_s=-1", check=False)
    assert completed.returncode == 2 and "error: train.hang_timeout_s" in completed.stderr


@pytest.mark.parametrize(
    ("hang_timeout_s", "usr1"),
    [(15, False), pytest.param(600, True, marks=pytest.mark.slow)],
    ids=["timeout", "usr1"],
)
def test_a_stopped_rank_ends_the_run(tmp_path, corpus, hang_timeout_s, usr1):
    """Rank 1 SIGSTOPped after step 3: rank 0's watchdog ends the run with one line and exit 5,
    after hang_timeout_s (or, once USR1 came, after SIGNAL_PATIENCE_S in a step), and torchrun
    removes the stopped rank. Without the watchdog gloo would wait 30 minutes."""
    run_dir, log = tmp_path / "run", tmp_path / "stderr.log"
    argv = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"),
        *("-m", "train", f"run_dir={run_dir}", f"data.corpus={corpus}", "data.max_duration=8"),
        *("wandb.enabled=false", "train.max_steps=1000", "checkpoint.interval=2"),
        f"train.hang_timeout_s={hang_timeout_s}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("w") as stderr:
        torchrun = subprocess.Popen(
            argv,
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )
    stopped = None
    ranks: dict[int, psutil.Process] = {}
    try:
        wait_for_step(run_dir, 3, lambda: torchrun.poll() is None)
        ranks = rank_processes(torchrun.pid)
        stopped = ranks[1]
        stopped.suspend()
        paused = time.monotonic()
        if usr1:
            ranks[0].send_signal(signal.SIGUSR1)
        expected = SIGNAL_PATIENCE_S if usr1 else hang_timeout_s
        with suppress(subprocess.TimeoutExpired):
            torchrun.wait(timeout=expected + TORCHRUN_KILL_S + MARGIN_S)
        took = time.monotonic() - paused
        returncode = torchrun.poll()
    finally:
        for rank in ranks.values():  # they have sessions of their own: never leave one behind
            with suppress(psutil.Error):
                rank.kill()
        if torchrun.poll() is None:
            os.killpg(torchrun.pid, signal.SIGKILL)
            torchrun.wait()
    stderr = log.read_text()
    assert returncode is not None, f"still running {took:.0f} s after the stop: {stderr[-3000:]}"
    assert returncode != 0 and "exitcode  : 5" in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(HUNG_LINE), stderr[-3000:]
    assert f"train.hang_timeout_s={hang_timeout_s}" in errors[0]
    assert ("SIGUSR1 came" in errors[0]) == usr1, errors[0]
    assert took > expected - 5, f"the watchdog fired after {took:.0f} s, before its timeout"


@pytest.mark.slurm
@pytest.mark.slow
def test_a_chain_goes_on_after_a_rank_hangs(slurm_cluster, tmp_path, corpus):
    """2 jobs of 2-rank training on the loopback cluster: a rank of job 0 stopped after step 6
    ends job 0 within hang_timeout_s (its time limit is 10 minutes), FAILED with exit 5 named,
    and job 1 resumes from the last checkpoint and finishes, losing at most one interval."""
    run_dir, hang_timeout_s, interval = tmp_path / "run", 20, 4
    summary = launch_training(
        2,
        run_dir,
        "recipes/train_tiny_fsdp2.yaml",
        corpus,
        "train.max_steps=16",
        f"checkpoint.interval={interval}",
        f"train.hang_timeout_s={hang_timeout_s}",
    )
    chain = summary["chain_id"]
    wait_for_step(run_dir, 6)
    [stopped] = job_ranks(chain, job_index=0, rank=1)
    stopped.suspend()
    paused = time.monotonic()
    try:
        while chain_status(chain)["jobs"][0]["state"] not in FINISHED:
            assert time.monotonic() - paused < hang_timeout_s + TORCHRUN_KILL_S + 2 * MARGIN_S, (
                "job 0 still runs with a stopped rank"
            )
            time.sleep(1)
        final = wait_chain(chain, timeout=400)
    finally:
        with suppress(psutil.Error):
            stopped.kill()
    assert [job["state"] for job in final["jobs"]] == ["FAILED", "COMPLETED"], final
    logs = run_tool("orchestrator", "logs", chain).stdout
    assert HUNG_LINE in logs and "exitcode  : 5" in logs, logs[-3000:]
    resumed = re.search(rf"resumed from {run_dir}/checkpoints/step_(\d+) at step", logs)
    assert resumed, logs[-3000:]
    rows = [row for row in metrics(run_dir) if "loss" in row]
    steps = {index: [row["step"] for row in rows if row["job_index"] == index] for index in (0, 1)}
    saved = int(resumed.group(1))
    assert steps[0][-1] - saved <= interval, (saved, steps)
    assert steps[1] == list(range(saved + 1, 17)), (saved, steps)
