"""A real SLURM time limit reaching the trainer: SLURM itself sends USR1 ``signal_grace`` seconds
before a job's limit (the template's ``--signal=B:USR1@grace``), the batch shell passes it on to
the ranks, the training saves and exits 0 before the limit, and the chain's next job resumes.

SLURM checks time limits every 30 s (PERIODIC_TIMEOUT, compiled into slurmctld 22.05; no
slurm.conf key changes it; the loopback cluster sets no OverTimeLimit), and sends the warning at
the first check where ``now + grace + 30 >= end``. With a 1-minute limit (the least a job can
ask for) and a grace of 30 s, that is the first check after the job starts (0-30 s in), and the
limit's own kill comes exactly two checks (60 s) later: the most room SLURM gives a 1-minute job.
Once SLURM sent no warning at all (a job started 0.4 s after a check); the batch script also
exports the job's end time less the grace (``ORCH_STOP_AT``), and the training stops by itself then.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
import yaml

from contract import job_env
from tests.harness.chains import launch_training, wait_chain
from tests.harness.process import REPO, run_tool
from tests.harness.training import metrics_or_empty, train
from train.loop.stop import StopRequest

LIMIT_S = 60  # --time=1, the shortest limit SLURM takes
GRACE_S = 30  # with SLURM's 30 s check: warned at its first check, killed two checks later
NEAR = f"the job's time limit is near ({job_env.STOP_AT})"

# A trainer process that has stopped and exits, while a USR1 lands as its interpreter finalizes:
# a module-level object's finalizer sends it, at the point where Python has already put back the
# default action of the signals it handled.
EXITING = """
import os, signal
from train.loop.stop import StopRequest

class LateSignal:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGUSR1)

StopRequest().install()
late = LateSignal()
"""


def test_a_usr1_while_the_training_exits_is_harmless():
    """The batch script passes USR1 on every 5 s until the training has exited: one that lands
    while a rank that saved is exiting must not kill it (torchrun would exit 1 and SLURM mark the
    job FAILED after a clean stop; seen in the chain below before train/loop/stop.py ignored it)."""
    done = subprocess.run(
        [sys.executable, "-c", EXITING],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, (done.returncode, done.stderr)


def test_the_job_stops_by_itself_at_the_time_its_script_hands_it():
    """SLURM's USR1 can be lost (seen: a 1-minute job started 0.4 s after SLURM's check was never
    warned and was killed at its limit); the stop time the batch script exports is a second path."""
    passed = StopRequest.for_job(0.0, {job_env.STOP_AT: str(time.time() - 1)})
    assert passed.local_flag() == 1.0
    assert passed.reason(passed.local_flag()) == f"the job's time limit is near ({job_env.STOP_AT})"
    ahead = StopRequest.for_job(0.0, {job_env.STOP_AT: str(time.time() + 3600)})
    assert ahead.local_flag() == 0.0 and ahead.reason(0.0) is None
    assert StopRequest.for_job(0.0, {}).stop_at is None
    with pytest.raises(ValueError, match="ORCH_STOP_AT='soon' is not epoch seconds"):
        StopRequest.for_job(0.0, {job_env.STOP_AT: "soon"})


def test_a_job_past_its_stop_time_saves_at_the_first_sync_step_and_skips_validation(
    tmp_path, corpus
):
    """The trainer side of ``ORCH_STOP_AT``: past it, every rank agrees to stop at the next sync
    step, saves, leaves validation out (the limit is near) and exits 0 for the next job."""
    run_dir = tmp_path / "run"
    done = train(
        run_dir,
        corpus,
        "train.max_steps=1000",
        "eval.interval=1000",
        nproc=2,
        env={job_env.STOP_AT: str(time.time() - 1)},
    )
    assert f"stopping at step 1: {NEAR}" in done.stderr, done.stderr[-2000:]
    assert "no validation at the end of this job: its time limit is near" in done.stderr
    assert (run_dir / "checkpoints" / "step_1").is_dir()


@pytest.mark.slurm
@pytest.mark.slow
def test_the_time_limit_stops_training_and_the_next_job_resumes(slurm_cluster, tmp_path, corpus):
    """The shipped 2-rank recipe with a 1-minute limit, 2 jobs: each hears USR1 from SLURM
    (nothing in the test signals them), saves and ends COMPLETED (not TIMEOUT) within its limit;
    job 1 resumes from job 0's checkpoint at the next step."""
    recipe = yaml.safe_load((REPO / "recipes/train_tiny_fsdp2.yaml").read_text())
    recipe.update(time="1", signal_grace=GRACE_S)
    path = tmp_path / "one_minute.yaml"
    path.write_text(yaml.safe_dump(recipe))
    run_dir = tmp_path / "run"
    summary = launch_training(
        2,
        run_dir,
        str(path),
        corpus,
        "wandb.enabled=false",
        "train.max_steps=100000",  # more than a minute's worth: only the limit can end job 0
        "checkpoint.interval=100000",  # the only save is the one on the way out
    )
    chain = summary["chain_id"]
    [script] = run_dir.glob("*.sub")
    assert "#SBATCH --time=1\n" in script.read_text()
    assert f"#SBATCH --signal=B:USR1@{GRACE_S}\n" in script.read_text()

    # Each job: queueing, a slow start on a loaded machine, then at most the limit.
    final = wait_chain(chain, timeout=2 * (LIMIT_S + 90))

    logs = run_tool("orchestrator", "logs", chain).stdout
    assert logs.count(f"before its time limit ({job_env.STOP_AT})") == 2, logs[-3000:]
    # USR1 comes at least 30 s before the stop time; the stop time is for a warning SLURM lost.
    stopped = re.findall(rf"stopping at step (\d+): (SIGUSR1|{re.escape(NEAR)})", logs)
    assert len(stopped) == 2, logs[-3000:]
    stops = [int(step) for step, _ in stopped]
    for job, (step, why) in zip(final["jobs"], stopped, strict=True):
        assert job["state"] == "COMPLETED" and job["exit_code"] == 0, final  # not TIMEOUT
        minutes, seconds = job["elapsed"].split(":")[-2:]
        assert int(minutes) * 60 + int(seconds) < LIMIT_S, job
        if why == "SIGUSR1":
            line = f"[orch] training stopped on SIGUSR1 after saving step {step} (exit status 0)"
            assert line in logs
        else:
            assert f"training stopped on its budget after saving step {step}" in logs
    # Each stop on SIGUSR1 was SLURM's warning passed on by the script; a warning may also come
    # while the ranks already stop at ORCH_STOP_AT (seen: both within one sync interval).
    forwarded = logs.count("[orch] SIGUSR1: asking the training to stop")
    signalled = [why for _, why in stopped].count("SIGUSR1")
    assert signalled <= forwarded <= len(stopped), logs[-3000:]
    assert f"resumed from {run_dir}/checkpoints/step_{stops[0]} at step {stops[0]}" in logs
    rows = [(row["job_index"], row["step"]) for row in metrics_or_empty(run_dir) if "loss" in row]
    assert rows == [(0, step) for step in range(1, stops[0] + 1)] + [
        (1, step) for step in range(stops[0] + 1, stops[1] + 1)
    ]
