"""The first rung of recovery: a training that fails in a way a new process fixes is launched
again inside its own job (orchestrator/in_job.py), on the loopback cluster with real ranks.

A SIGKILLed rank restarts in place from the newest checkpoint, loses only the steps since it,
and trains on exactly as an uninterrupted run from that checkpoint does, bit for bit; the same
failure twice, or too little time left in the job, goes to the chain's replacement logic. A
hung rank's restart is in tests/test_hang.py (with the other hangs, whose waits overlap), the
node-loss rung (replacement, never in place) in tests/test_self_healing.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import psutil
import pytest

from orchestrator.in_job import MIN_RESTART_S, checkpoint_interval_s, refusal
from tests.harness.chains import launch_json, tiny_training_chain, wait_chain_quietly
from tests.harness.process import run_tool
from tests.harness.training import (
    KILLED_RANK_ENDS_JOB_S,
    metrics,
    metrics_or_empty,
    run_ranks,
    training_rank,
    wait_until,
)

RESTARTED = "restarting the training in place"
MAX_STEPS, INTERVAL = 12, 4  # the trainings' train.max_steps and checkpoint.interval


def test_a_failure_is_restarted_until_it_repeats_or_time_or_restarts_run_out():
    allowed = dict(cluster_state="", used=0, allowed=2, restarted_for=None, needed_s=60.0)
    assert refusal(**allowed, failure="exit 6 (step 7)", seconds_left=None) is None
    assert refusal(**allowed, failure="exit 6 (step 7)", seconds_left=61.0) is None
    short = refusal(**allowed, failure="exit 6 (step 7)", seconds_left=59.0)
    assert short == "59 s left in the job, less than a checkpoint interval (60 s)"
    again = {**allowed, "restarted_for": "exit 6 (step 7)", "used": 1}
    assert "same failure came back" in refusal(
        **again, failure="exit 6 (step 7)", seconds_left=None
    )
    assert refusal(**again, failure="exit 6 (step 9)", seconds_left=None) is None
    spent = {**allowed, "used": 2}
    assert "2 of 2 in-job restarts used" in refusal(**spent, failure="x", seconds_left=None)
    lost = {**allowed, "cluster_state": "NODE_FAIL"}
    assert "cluster ended the job (NODE_FAIL)" in refusal(**lost, failure="x", seconds_left=None)


def test_the_time_a_restart_needs_is_the_runs_checkpoint_interval(tmp_path):
    assert checkpoint_interval_s(tmp_path) == MIN_RESTART_S  # nothing to measure yet
    for step, written in ((4, 1000.0), (8, 1300.0)):
        checkpoint = tmp_path / "checkpoints" / f"step_{step}"
        checkpoint.mkdir(parents=True)
        (checkpoint / "COMPLETE").write_text("")
        os.utime(checkpoint / "COMPLETE", (written, written))
    assert checkpoint_interval_s(tmp_path) == 300.0


def job_log(run_dir: Path) -> str:
    return "".join(log.read_text() for log in sorted((run_dir / "logs").glob("*.out")))


def losses(rows: list[dict]) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


@pytest.mark.slurm
@pytest.mark.slow
def test_a_killed_rank_restarts_in_place_as_an_uninterrupted_run_from_its_checkpoint(
    slurm_cluster, tmp_path, corpus
):
    """Job 0 of a 1-job chain (2 ranks) has rank 1 SIGKILLed after its first checkpoint: the
    batch script launches the training again in the same job, which resumes from that
    checkpoint and finishes, one job, one restart on record (manifest, status, metrics rows).
    Its losses equal, bit for bit, those of a run started from a copy of that checkpoint.
    Timed against the job's own first launch (submission to first step) on the same machine:
    the killed rank's peers end, and the new ranks start, within the bound of a job's end after
    such a kill."""
    run_dir = tmp_path / "run"
    overrides = (f"train.max_steps={MAX_STEPS}", f"checkpoint.interval={INTERVAL}")
    summary = tiny_training_chain(run_dir, corpus, 1, 0, *overrides, "checkpoint.keep=10")
    submitted, chain = time.time(), summary["chain_id"]
    wait_until(lambda: len(losses(metrics_or_empty(run_dir))) >= INTERVAL + 2, 300, "step 6")
    victim = wait_until(lambda: training_rank(run_dir), 30, "a rank of the job")
    peers = [rank for rank in victim.parent().children() if rank.pid != victim.pid]
    first_launch_s = min(r["time"] for r in metrics(run_dir) if "loss" in r) - submitted
    killed = time.time()
    os.kill(victim.pid, signal.SIGKILL)
    psutil.wait_procs(peers, timeout=120)
    peers_ended = time.time()
    relaunched = wait_until(lambda: training_rank(run_dir), 120, "a rank of the new launch")
    relaunch_s = relaunched.create_time() - peers_ended
    restarted = wait_until(
        lambda: next((r for r in metrics_or_empty(run_dir) if r.get("in_job_restart")), None),
        120,
        "the restarted training's first step",
    )
    final = wait_chain_quietly(run_dir, chain, timeout=240)
    assert [job["state"] for job in final["jobs"]] == ["COMPLETED"], final
    [job] = json.loads((run_dir / "manifest.json").read_text())["jobs"]
    assert (job["outcome"], job["in_job_restarts"]) == ("finished", 1), job
    log = job_log(run_dir)
    resumed = re.findall(r"resumed from \S+/step_(\d+) at step", log)
    restart_line = f"(exit 6): a rank lost a peer: {RESTARTED} (1 of 2)"
    assert len(resumed) == 1 and restart_line in log, log[-3000:]
    saved = int(resumed[0])
    assert restarted["step"] == saved + 1
    rows = metrics(run_dir)
    before = [row["step"] for row in rows if "loss" in row and not row.get("in_job_restart")]
    after = losses([row for row in rows if row.get("in_job_restart") == 1])
    assert saved < max(before) <= saved + INTERVAL  # only the steps since the checkpoint lost
    assert sorted(after) == list(range(saved + 1, MAX_STEPS + 1))
    status = run_tool("orchestrator", "status", chain).stdout
    assert "restarted in place 1x" in status, status

    # An uninterrupted run from a copy of that checkpoint, with the job's seed and overrides.
    again = tmp_path / "again"
    (again / "checkpoints").mkdir(parents=True)
    shutil.copytree(
        run_dir / "checkpoints" / f"step_{saved}", again / "checkpoints" / f"step_{saved}"
    )
    command = ["-m", "train", "--config-name", "tiny_fsdp2", f"seed={job['seed']}"]
    command += [f"run_dir={again}", f"data.corpus={corpus}", "data.max_duration=8"]
    run_ranks([*command, "wandb.enabled=false", *overrides], 2, env={"ORCH_JOB_INDEX": "0"})
    assert losses(metrics(again)) == after

    # The restart's own seconds, against the job's first launch (submission to first step) as
    # a machine's load changes them: the killed rank's peers end as a job's do after such a kill
    # (never by torchrun's 30-s SIGKILL), and the end hook, srun and torchrun start the new ranks
    # within the same bound (no stalled step creation, no wait). The new ranks' own start and
    # resume is any launch's (docs/faults.md times it end to end).
    teardown_s = peers_ended - killed
    print(f"peers ended {teardown_s:.1f} s after the kill, new ranks {relaunch_s:.1f} s later,")
    print(f"first restarted step {restarted['time'] - killed:.1f} s after the kill;")
    print(f"the first launch took {first_launch_s:.1f} s")
    bound = max(KILLED_RANK_ENDS_JOB_S, first_launch_s)
    assert teardown_s < bound and relaunch_s < bound, (teardown_s, relaunch_s, log[-3000:])
    assert "forcefully exiting via" not in log and "temporarily disabled" not in log


# A command of its own that fails as a lost peer does (exit 6) on its first FAILS launches of
# the chain (a count in the run dir), and says which launch it is.
FLAKY = """\
n=$(cat "$ORCH_RUN_DIR/launches" 2>/dev/null || echo 0)
echo $((n + 1)) > "$ORCH_RUN_DIR/launches"
echo "launch $n, in-job restart ${ORCH_IN_JOB_RESTART:-0}"
if [ "$n" -lt "$FAILS" ]; then exit 6; fi
"""


def flaky_chain(tmp_path: Path, fails: int, time_limit: str, *launch_args: str) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "flaky.sh"
    script.write_text(FLAKY)
    recipe = tmp_path / "flaky.yaml"
    recipe.write_text(
        f'template: single\ntime: "{time_limit}"\nsignal_grace: 30\ncommand: [bash, {script}]\n'
    )
    run_dir = tmp_path / "run"
    summary = launch_json(
        "-n1", "--run-dir", str(run_dir), *launch_args, str(recipe), env={"FAILS": str(fails)}
    )
    wait_chain_quietly(run_dir, summary["chain_id"], timeout=120)
    return run_dir


@pytest.mark.slurm
def test_the_same_failure_twice_goes_to_the_chains_replacement(empty_queue, tmp_path):
    """Every launch fails alike: job 0 restarts once, then its second identical failure is
    judged and replaced (--retries 1); the replacement does the same; 4 launches in all."""
    run_dir = flaky_chain(tmp_path, 99, "00:05:00", "--retries", "1")
    jobs = json.loads((run_dir / "manifest.json").read_text())["jobs"]
    assert [(j["outcome"], j["replaces"], j["in_job_restarts"]) for j in jobs] == [
        ("failed", None, 1),
        ("failed", 0, 1),
    ]
    assert (run_dir / "launches").read_text().strip() == "4"
    log = job_log(run_dir)
    assert log.count("the same failure came back at the same place after a restart") == 2, log
    assert "launch 1, in-job restart 1" in log and "launch 3, in-job restart 1" in log, log


@pytest.mark.slurm
def test_no_restart_in_place_without_a_checkpoint_intervals_time_left(empty_queue, tmp_path):
    """A 1-minute job stops its training 30 s before its end: less than the minimum a restart
    needs, so the failure is judged at once; --restarts-in-job 0 turns restarts off."""
    short = flaky_chain(tmp_path / "short", 1, "00:01:00")
    assert (short / "launches").read_text().strip() == "1"
    assert "s left in the job, less than a checkpoint interval" in job_log(short)
    off = flaky_chain(tmp_path / "off", 1, "00:05:00", "--restarts-in-job", "0")
    [job] = json.loads((off / "manifest.json").read_text())["jobs"]
    assert (job["outcome"], job["in_job_restarts"]) == ("failed", 0)
    assert RESTARTED not in job_log(off)
