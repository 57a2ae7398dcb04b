"""Self-healing chains: replacements for failed jobs (--retries), a finished training cancelling
the queued rest, a diverged one stopping the chain, and a clean stop on scancel reported as one.
The SLURM tests run on the loopback cluster; the first few need no SLURM."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from contract.job_end import job_end_record, outcome_line, read_outcome
from contract.seeds import chain_seeds
from orchestrator import processes
from orchestrator.backends.run_dir import run_dir_status
from orchestrator.chain_hooks import ChainKeeper
from orchestrator.chain_judgement import BLOCKING_EXITS, ended_state, judge, stalled_jobs
from orchestrator.cluster.daemons import daemon_pids
from orchestrator.manifest import JobRecord, Manifest
from tests.harness.chains import (
    STAND_IN_TRAINER,
    launch_json,
    launch_training,
    tiny_training_chain,
    wait_chain_quietly,
    write_sub,
)
from tests.harness.cluster import cluster_cli
from tests.harness.process import REPO, run_tool

# A hand-written .sub that follows the chain-hook contract (docs/contracts.md). Its work fails
# while the run dir's counter is below FAILURES, or, for the job of index KILL_AT, the batch shell
# kills itself before it can run its end hook (as a lost node or SIGKILL would).
HOOKED_BODY = """
hook=0
"$ORCH_PYTHON" -m orchestrator.chain_hooks start || hook=$?
if [ "$hook" = 100 ]; then exit 0; fi
echo "$ORCH_JOB_INDEX $SEED" >> "$ORCH_RUN_DIR/ran"
if [ "$ORCH_JOB_INDEX" = "${KILL_AT:-none}" ]; then kill -KILL $$; fi
n=$(cat "$ORCH_RUN_DIR/count" 2>/dev/null || echo 0)
echo $((n + 1)) > "$ORCH_RUN_DIR/count"
status=0
if [ "$n" -lt "${FAILURES:-0}" ]; then status=1; fi
"$ORCH_PYTHON" -m orchestrator.chain_hooks end "$status" ||
  echo "[orch] training exited with status $status"
exit "$status"
"""


# W&B is not what the training chains here check (its start costs a job seconds of CPU); the
# clean stop on scancel keeps it, as a user's job has it running when the signal comes.
NO_WANDB = "wandb.enabled=false"


def manifest_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def logs_tail(run_dir: Path, lines: int = 15) -> dict[str, list[str]]:
    """The last lines of each job's log: what a hook said, or that it never ran."""
    return {
        log.name: log.read_text(errors="replace").splitlines()[-lines:]
        for log in sorted((run_dir / "logs").glob("*.out"))
    }


def sacct_run(job_id: str) -> str:
    """Accounting's state, nodes and run time of the job ("None assigned": it never ran)."""
    out = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-j", job_id, "--format=State,NodeList,Elapsed"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    return out.strip()


# ---- no SLURM ----


def record(code: int, step: int, signalled: bool, signal: str | None, diverged: bool) -> dict:
    return job_end_record(
        code, step=step, max_steps=8, signalled=signalled, signal_name=signal, diverged=diverged
    )


def test_end_records_map_to_chain_outcomes():
    finished = job_end_record(
        0, step=8, max_steps=8, signalled=False, signal_name=None, diverged=False
    )
    assert finished == {
        "reason": "max_steps",
        "step": 8,
        "finished": True,
        "saved": True,
        "signal": None,
        "exit_code": 0,
        "error": None,
    }
    stopped = job_end_record(
        0, step=5, max_steps=8, signalled=True, signal_name="SIGTERM", diverged=False
    )
    budget = job_end_record(
        0, step=5, max_steps=8, signalled=False, signal_name=None, diverged=False
    )
    diverged = job_end_record(
        3, step=4, max_steps=8, signalled=False, signal_name=None, diverged=True
    )
    error = job_end_record(
        1, step=2, max_steps=8, signalled=False, signal_name=None, diverged=False
    )
    assert [r["reason"] for r in (stopped, budget, diverged, error)] == [
        "signal",
        "budget",
        "diverged",
        "error",
    ]
    assert judge(finished, 0, "", True).outcome == "finished"
    assert judge(stopped, 1, "", True).outcome == "stopped"
    assert judge(budget, 0, "", True).outcome == "stopped"
    assert judge(diverged, 1, "", True).outcome == "diverged"
    assert judge(error, 1, "", True).outcome == "failed"
    # A bad config or a full disk would fail a replacement the same way: no retry is spent.
    for code in (2, 4):
        blocked = job_end_record(
            code, step=0, max_steps=8, signalled=False, signal_name=None, diverged=False
        )
        assert judge(blocked, 1, "", True).outcome == "blocked"
    assert judge(None, 0, "", True).outcome == "completed"
    assert judge(None, None, "CANCELLED", False).outcome == "not_started"

    # The log's last line: a clean stop is told as one, and the run-dir reader understands both.
    line = outcome_line(stopped, 1)
    assert line == (
        "[orch] training stopped on SIGTERM after saving step 5 "
        "(launcher exit status 1 is its own signal handling)"
    )
    assert read_outcome(f"[train] step 5\n{line}\n") == ("SIGTERM", 1)
    assert read_outcome(outcome_line(stopped, 0)) == ("SIGTERM", 0)
    assert read_outcome(outcome_line(error, 1)) == (None, 1)
    assert read_outcome(f"{outcome_line(stopped, 0)}\n{outcome_line(budget, 0)}") == (None, 0)
    assert read_outcome("[train] step 5\n") is None


@pytest.mark.parametrize(
    ("fields", "state"),
    [
        # A node lost under a multi-node step: the batch shell's end hook sees the job ending.
        ({"JobState": "COMPLETING", "Reason": "NodeDown"}, "NODE_FAIL"),
        ({"JobState": "NODE_FAIL", "Reason": "NodeDown"}, "NODE_FAIL"),
        ({"JobState": "COMPLETING", "Reason": "TimeLimit"}, "TIMEOUT"),
        # Nothing decided yet, or decided by the preemption check, or SLURM did not answer.
        ({"JobState": "RUNNING", "Reason": "None"}, ""),
        ({"JobState": "COMPLETING", "Reason": "None"}, ""),
        ({"JobState": "PREEMPTED", "Reason": "None"}, ""),
        ({}, ""),
    ],
)
def test_the_end_hook_reads_the_end_slurm_has_decided(fields, state):
    assert ended_state(fields) == state


def end_record(code: int, step: int = 5, saved_on: str | None = None) -> dict:
    return job_end_record(
        code,
        step=step,
        max_steps=8,
        signalled=saved_on is not None,
        signal_name=saved_on,
        diverged=False,
    )


@pytest.mark.parametrize(
    ("record", "status", "state", "listed", "retried", "says"),
    [
        # What the cluster did: even after a save, the chain lost a job's worth of time.
        (end_record(0, saved_on="SIGTERM"), None, "NODE_FAIL", (), True, "NODE_FAIL) after saving"),
        (end_record(0, saved_on="SIGTERM"), None, "PREEMPTED", (), True, "(PREEMPTED)"),
        (None, None, "NODE_FAIL", (), True, "cut short by the cluster"),
        (end_record(1), None, "TIMEOUT", (), True, "time limit before saving"),
        (end_record(0, saved_on="SIGUSR1"), None, "TIMEOUT", (), False, "stopped on SIGUSR1"),
        # What the training's ranks said.
        (end_record(5), 1, "", (), True, "a rank hung"),
        (end_record(6), 1, "", (), True, "lost a peer"),
        (end_record(1), 1, "", (), False, "--retry-on-exit 1 retries it"),
        (end_record(1), 1, "", (1,), True, "listed in --retry-on-exit"),
        # A command of its own (no record): its exit status.
        (None, 137, "", (), True, "killed by SIGKILL"),
        (None, 5, "", (), True, "a rank hung"),
        (None, 1, "", (), False, "not retried"),
        (None, 1, "", (1, 7), True, "listed"),
        (None, 127, "", (), False, "found no such command: the job's PATH lacks"),
        (None, 127, "", (127,), True, "listed"),
        (None, 126, "", (), False, "cannot execute (check its permissions)"),
        (None, None, "FAILED", (), True, "without running its end hook"),
        (None, None, "OUT_OF_MEMORY", (), False, "without running its end hook"),
    ],
)
def test_only_failures_a_new_job_can_fix_are_retried(record, status, state, listed, retried, says):
    ending = judge(record, status, state, True, listed)
    assert (ending.outcome in ("failed",) and ending.retry) == retried, ending
    assert says in ending.detail, ending


def keeper_for(tmp_path: Path, max_stalled: int, steps: list[int | None]) -> ChainKeeper:
    """A chain of len(steps) judged jobs, job k having left checkpoint steps[k] (None: none)."""
    manifest = Manifest(
        chain_id="c",
        recipe="recipes/train_tiny.yaml",
        recipe_sha256="-",
        script="s.sub",
        run_dir=str(tmp_path),
        backend="local",
        dependency_kind="afterany",
        num_jobs=len(steps) + 1,
        args=["train.max_steps=600"],
        base_seed=None,
        git_sha=None,
        git_dirty=None,
        created=0.0,
        status="submitted",
        max_stalled=max_stalled,
        start_step=100,
    )
    for index, step in enumerate(steps):
        manifest.jobs.append(
            JobRecord(
                index=index,
                seed=index,
                job_id=str(index),
                outcome="failed",
                step=step,
                checkpoint_step=step,
                measured=True,
            )
        )
    manifest.jobs.append(JobRecord(index=len(steps), seed=9, job_id="9"))
    return ChainKeeper(manifest, None)


def test_jobs_that_save_nothing_newer_stall_the_chain(tmp_path):
    """Progress is a newer complete checkpoint than the chain had before (100 at submission)."""
    assert [job.index for job in stalled_jobs(keeper_for(tmp_path, 2, [200, 200]).manifest)] == [1]
    assert len(stalled_jobs(keeper_for(tmp_path, 2, [100, None]).manifest)) == 2
    assert stalled_jobs(keeper_for(tmp_path, 2, [100, 150]).manifest) == []


def test_incomplete_names_the_step_and_the_command_that_continues(tmp_path):
    keeper = keeper_for(tmp_path, 0, [222, 522])
    keeper.manifest.jobs.pop()  # nothing more queued: job 1 was the last
    keeper.manifest.num_jobs = 2
    keeper.manifest.jobs[-1].outcome = "stopped"
    keeper.settle()
    assert keeper.manifest.status == "incomplete"
    assert "ended with training unfinished at step 522" in keeper.manifest.ended
    assert keeper.manifest.ended.endswith(
        f"auto_launch -n1 --run-dir {tmp_path} recipes/train_tiny.yaml -- train.max_steps=600"
    )


def test_run_dir_reads_a_clean_stop_from_the_log(tmp_path):
    """Where SLURM has forgotten the job, its log's outcome line still tells a clean stop."""
    stopped = record(0, 5, True, "SIGTERM", False)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "r-7.out").write_text(f"[train] ...\n{outcome_line(stopped, 1)}\n")
    status = run_dir_status(tmp_path, "7", "logs/*-7.out", "gone")
    assert (status.state, status.exit_code) == ("CANCELLED", 1)
    assert "stopped on SIGTERM after saving" in status.reason


@pytest.mark.parametrize(
    ("options", "body", "message"),
    [
        (["--retries", "1"], "true\n", "never runs the chain hook"),
        (["--retries", "1", "--dependency", "afterok"], HOOKED_BODY, "afterany or singleton"),
        (["--retries", "-1"], HOOKED_BODY, "give 0..1000"),
        (["--retries", "1", "--retry-on-exit", "1,x"], HOOKED_BODY, "give exit codes 1..255"),
        (["--retry-on-exit", "1"], HOOKED_BODY, "give --retries K too"),
        (["--max-stalled", "-1"], HOOKED_BODY, "give 0 (never stop)"),
    ],
)
def test_retries_refused_where_they_cannot_work(tmp_path, options, body, message):
    recipe = write_sub(tmp_path / "job.sub", body)
    completed = run_tool("auto_launch", *options, "--run-dir", str(tmp_path / "run"), str(recipe))
    assert completed.returncode == 2, completed.stderr
    assert message in completed.stderr
    assert not (tmp_path / "run" / "manifest.json").exists()


# ---- on the loopback cluster ----


@pytest.mark.slurm
def test_failed_jobs_are_replaced_until_one_succeeds(slurm_cluster, tmp_path):
    """The work fails twice, then succeeds: exactly two replacements, each after the chain's last
    job, each with the next seed of the chain's sequence, each naming the job it replaces."""
    recipe = write_sub(tmp_path / "flaky.sub", HOOKED_BODY)
    run_dir = tmp_path / "run"
    summary = launch_json(
        "-n1",
        "--retries",
        "3",
        "--retry-on-exit",
        "1",
        "--seed",
        "7",
        "--run-dir",
        str(run_dir),
        str(recipe),
        env={"FAILURES": "2"},
    )
    final = wait_chain_quietly(run_dir, summary["chain_id"], timeout=120)
    assert [job["state"] for job in final["jobs"]] == ["FAILED", "FAILED", "COMPLETED"], final
    manifest = manifest_of(run_dir)
    jobs = manifest["jobs"]
    assert manifest["retries"] == 3 and manifest["status"] == "complete"
    assert [job["outcome"] for job in jobs] == ["failed", "failed", "completed"]
    assert [job["replaces"] for job in jobs] == [None, 0, 1]
    assert jobs[1]["reason"] == (
        "exited with status 1 and no end-of-job record, listed in --retry-on-exit"
    )
    assert [job["seed"] for job in jobs] == chain_seeds(3, 7)
    ids = [job["job_id"] for job in jobs]
    assert [job["dependency"] for job in jobs] == [None, f"afterany:{ids[0]}", f"afterany:{ids[1]}"]
    ran = (run_dir / "ran").read_text().split()
    assert ran == ["0", str(jobs[0]["seed"]), "1", str(jobs[1]["seed"]), "2", str(jobs[2]["seed"])]
    log = run_tool("orchestrator", "logs", summary["chain_id"], "--job", "0").stdout
    assert f"queued job 1 (id {ids[1]}, seed {jobs[1]['seed']}) to replace job 0" in log
    assert log.rstrip().endswith("[orch] training exited with status 1")


@pytest.mark.slurm
def test_a_chain_without_progress_stalls_and_an_unfinished_one_says_how_to_go_on(
    slurm_cluster, tmp_path
):
    """Two chains side by side. Each job of the first fails (exit 1, listed as worth a retry)
    without a checkpoint: after --max-stalled 2 jobs the chain is stalled, its queued job
    cancelled, not run, and no third replacement spent. The second's only job stops on its
    budget after saving step 5: the chain is incomplete, its line naming the step and the
    command that queues more."""
    recipe = write_sub(tmp_path / "trainer.sub", STAND_IN_TRAINER)
    stalls, stops = tmp_path / "stalls", tmp_path / "stops"
    stalled = launch_json(
        "-n3",
        "--retries",
        "3",
        "--retry-on-exit",
        "1",
        "--run-dir",
        str(stalls),
        str(recipe),
        env={"CODE": "1"},
    )
    unfinished = launch_json(
        "-n1",
        "--run-dir",
        str(stops),
        str(recipe),
        "--",
        "train.max_steps=8",
        env={"CODE": "0", "SAVE": "5"},
    )
    wait_chain_quietly(stalls, stalled["chain_id"], timeout=120)
    wait_chain_quietly(stops, unfinished["chain_id"], timeout=120)
    manifest = manifest_of(stalls)
    assert manifest["status"] == "stalled", manifest
    assert [(job["outcome"], job["replaces"]) for job in manifest["jobs"]] == [
        ("failed", None),
        ("failed", None),
        ("not_started", None),
        ("not_started", 0),
    ], manifest
    assert (
        "2 jobs in a row ended without a newer checkpoint (still no checkpoint" in manifest["ended"]
    )
    status = run_tool("orchestrator", "status", stalled["chain_id"]).stdout.splitlines()
    assert "stalled" in status[0] and status[1] == f"stalled: {manifest['ended']}", status

    manifest = manifest_of(stops)
    assert manifest["status"] == "incomplete", manifest
    assert (
        "ended with training unfinished at step 5; continue it with: auto_launch -n1"
        in manifest["ended"]
    )
    assert manifest["ended"].endswith(f"{recipe} -- train.max_steps=8")
    status = run_tool("orchestrator", "status", unfinished["chain_id"]).stdout.splitlines()
    assert "incomplete" in status[0] and status[1] == f"incomplete: {manifest['ended']}", status


@pytest.mark.slurm
def test_a_job_killed_before_its_hook_is_replaced_by_the_next_job(slurm_cluster, tmp_path):
    """Job 0's batch shell is SIGKILLed (no end hook): job 1, started by afterany, judges it at
    its own start and queues the replacement; the retry budget (1) is then spent."""
    recipe = write_sub(tmp_path / "killed.sub", HOOKED_BODY)
    run_dir = tmp_path / "run"
    summary = launch_json(
        "-n2", "--retries", "1", "--run-dir", str(run_dir), str(recipe), env={"KILL_AT": "0"}
    )
    final = wait_chain_quietly(run_dir, summary["chain_id"], timeout=120)
    manifest = manifest_of(run_dir)
    jobs = manifest["jobs"]
    assert [job["state"] for job in final["jobs"]] == ["FAILED", "COMPLETED", "COMPLETED"], final
    assert [job["outcome"] for job in jobs] == ["failed", "completed", "completed"]
    assert jobs[2]["replaces"] == 0
    assert "without running its end hook" in jobs[2]["reason"]
    assert jobs[2]["dependency"] == f"afterany:{jobs[1]['job_id']}"
    assert len({job["seed"] for job in jobs}) == 3
    log = run_tool("orchestrator", "logs", summary["chain_id"], "--job", "1").stdout
    assert "queued job 2" in log and "to replace job 0: retry 1 of 1" in log


@pytest.mark.slurm
def test_the_then_job_still_runs_after_a_replacement(slurm_cluster, tmp_path):
    """The --then job waited for job 0; once job 0's replacement is queued it waits for that."""
    recipe = write_sub(tmp_path / "flaky.sub", HOOKED_BODY)
    then = write_sub(tmp_path / "after.sub", 'echo "then $SEED" >> "$ORCH_RUN_DIR/ran"\n')
    run_dir = tmp_path / "run"
    summary = launch_json(
        "-n1",
        "--retries",
        "1",
        "--retry-on-exit",
        "1",
        "--seed",
        "3",
        "--then",
        str(then),
        "--run-dir",
        str(run_dir),
        str(recipe),
        env={"FAILURES": "1"},
    )
    final = wait_chain_quietly(run_dir, summary["chain_id"], timeout=120)
    assert [job["state"] for job in final["jobs"]] == ["FAILED", "COMPLETED", "COMPLETED"], final
    jobs = manifest_of(run_dir)["jobs"]
    assert [(job["index"], job["then"], job["replaces"]) for job in jobs] == [
        (0, False, None),
        (1, True, None),
        (2, False, 0),
    ]
    assert jobs[1]["dependency"] == f"afterany:{jobs[2]['job_id']}"
    assert [job["seed"] for job in jobs] == chain_seeds(3, 3)
    ran = (run_dir / "ran").read_text().split()
    assert ran == [
        "0",
        str(jobs[0]["seed"]),
        "2",
        str(jobs[2]["seed"]),
        "then",
        str(jobs[1]["seed"]),
    ]


def wait_manifest_settled(run_dir: Path, count: int, timeout: float = 60) -> dict:
    """The manifest once ``count`` jobs have an outcome (hooks finish just before their job)."""
    deadline = time.monotonic() + timeout
    while True:
        manifest = manifest_of(run_dir)
        if sum(job["outcome"] is not None for job in manifest["jobs"]) >= count:
            return manifest
        assert time.monotonic() < deadline, (manifest, logs_tail(run_dir))
        time.sleep(0.5)


def assert_never_ran(run_dir: Path, job_ids: list[str]) -> None:
    """The jobs were cancelled while pending: no log, no node, no run time."""
    for job_id in job_ids:
        assert not list((run_dir / "logs").glob(f"*-{job_id}.out")), "a cancelled job ran"
        state, nodes, elapsed = sacct_run(job_id).split("|")
        assert state.startswith("CANCELLED"), state
        assert (nodes, elapsed) == ("None assigned", "00:00:00"), "a cancelled job ran"


@pytest.mark.slurm
@pytest.mark.slow
def test_finished_training_cancels_the_queued_rest(slurm_cluster, tmp_path, corpus):
    """Job 0 reaches max_steps: jobs 1 and 2 are cancelled while pending and never run."""
    run_dir = tmp_path / "run"
    summary = launch_training(
        3, run_dir, "recipes/train_tiny_fsdp2.yaml", corpus, "train.max_steps=3", NO_WANDB
    )
    final = wait_chain_quietly(run_dir, summary["chain_id"], timeout=150)
    assert [job["state"] for job in final["jobs"]] == ["COMPLETED", "CANCELLED", "CANCELLED"]
    manifest = manifest_of(run_dir)
    assert manifest["status"] == "complete"
    ids = [job["job_id"] for job in manifest["jobs"]]
    assert manifest["ended"] == (
        f"job 0 (id {ids[0]}): training finished at step 3; "
        f"cancelled 2 queued job(s): {ids[1]} {ids[2]}"
    )
    assert [job["outcome"] for job in manifest["jobs"]] == [
        "finished",
        "not_started",
        "not_started",
    ]
    record = json.loads((run_dir / "job_ends" / f"0-{ids[0]}.json").read_text())
    assert record == {
        "reason": "max_steps",
        "step": 3,
        "finished": True,
        "saved": True,
        "signal": None,
        "exit_code": 0,
        "error": None,
    }
    assert_never_ran(run_dir, ids[1:])


@pytest.mark.slurm
@pytest.mark.slow
def test_diverged_training_stops_the_chain_without_retries(slurm_cluster, tmp_path, corpus):
    """Non-finite steps end job 0 as diverged (exit 3): the chain stops, its reason in the
    manifest, and no retry is spent although two were allowed."""
    run_dir = tmp_path / "run"
    summary = tiny_training_chain(
        run_dir,
        corpus,
        3,
        2,
        "train.max_steps=20",
        "train.nonfinite_limit=2",
        "debug.inject_nonfinite_steps=[2,3]",
        NO_WANDB,
    )
    final = wait_chain_quietly(run_dir, summary["chain_id"], timeout=150)
    assert [job["state"] for job in final["jobs"]] == ["FAILED", "CANCELLED", "CANCELLED"]
    manifest = manifest_of(run_dir)
    assert manifest["status"] == "diverged"
    assert "job 0" in manifest["ended"] and "training diverged at step 3" in manifest["ended"]
    assert [job["outcome"] for job in manifest["jobs"]] == [
        "diverged",
        "not_started",
        "not_started",
    ]
    assert [job["replaces"] for job in manifest["jobs"]] == [None] * 3
    status = run_tool("orchestrator", "status", summary["chain_id"]).stdout
    assert "diverged" in status.splitlines()[0]


@pytest.mark.slurm
@pytest.mark.slow
def test_unsavable_checkpoints_block_the_chain_without_retries(
    slurm_cluster, tmp_path, corpus, small_disk
):
    """The run dir's checkpoints are on a read-only disk: job 0's trainer exits 4 before its
    first step, the chain is blocked, no retry is spent although two were allowed, and the
    queued jobs are cancelled before they start (each would fail the same way)."""
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").symlink_to(small_disk)
    summary = tiny_training_chain(run_dir, corpus, 3, 2, NO_WANDB)
    final = wait_chain_quietly(run_dir, summary["chain_id"], timeout=150)
    assert [job["state"] for job in final["jobs"]] == ["FAILED", "CANCELLED", "CANCELLED"]
    manifest = manifest_of(run_dir)
    ids = [job["job_id"] for job in manifest["jobs"]]
    assert manifest["status"] == "blocked"
    assert manifest["ended"].startswith(
        f"job 0 (id {ids[0]}): {BLOCKING_EXITS[4]} (exit 4); no retry: fix it and queue again; "
        "error: checkpoints cannot be saved: read-only file system"
    )
    assert manifest["ended"].endswith(f"; cancelled 2 queued job(s): {ids[1]} {ids[2]}")
    assert [(job["outcome"], job["replaces"]) for job in manifest["jobs"]] == [
        ("blocked", None),
        ("not_started", None),
        ("not_started", None),
    ]
    record = json.loads((run_dir / "job_ends" / f"0-{ids[0]}.json").read_text())
    assert (record["reason"], record["exit_code"], record["step"]) == ("error", 4, 0)
    assert_never_ran(run_dir, ids[1:])
    status = run_tool("orchestrator", "status", summary["chain_id"]).stdout.splitlines()
    assert "blocked" in status[0], status
    assert any(line.startswith("warning: the run dir's disk is read-only") for line in status)
    [row] = [line for line in status if line.split()[:2] == ["0", ids[0]]]
    assert row.split()[3] == "FAILED" and row.split()[6] == "4", row  # the trainer's exit
    assert "blocked; error: checkpoints cannot be saved: read-only file system" in row, row


@pytest.mark.slurm
@pytest.mark.slow
def test_scancel_during_training_is_reported_as_a_clean_stop(slurm_cluster, tmp_path, corpus):
    """scancel: the ranks save on SIGTERM and torchrun exits 1 on its own signal; the log's last
    line says the training stopped after saving, and the hook spends no retry on it."""
    run_dir = tmp_path / "run"
    summary = tiny_training_chain(
        run_dir, corpus, 1, 1, "train.max_steps=500", "checkpoint.interval=1000"
    )
    job_id = summary["jobs"][0]["job_id"]
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count('"loss"') >= 2):
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], check=True, timeout=30)
    deadline = time.monotonic() + 60
    final = wait_chain_quietly(run_dir, summary["chain_id"], timeout=60)
    assert [job["state"] for job in final["jobs"]] == ["CANCELLED"], final
    manifest = wait_manifest_settled(run_dir, 1)
    assert [job["outcome"] for job in manifest["jobs"]] == ["stopped"], manifest
    record = json.loads((run_dir / "job_ends" / f"0-{job_id}.json").read_text())
    assert record["reason"] == "signal" and record["signal"] == "SIGTERM" and record["saved"]
    assert (run_dir / "checkpoints" / f"step_{record['step']}" / "COMPLETE").exists()
    log_path = next((run_dir / "logs").glob(f"*-{job_id}.out"))
    while "[orch] training " not in log_path.read_text().rstrip().splitlines()[-1]:
        assert time.monotonic() < deadline, log_path.read_text()[-3000:]
        time.sleep(0.5)
    log = log_path.read_text()
    last = log.rstrip().splitlines()[-1]
    # torchrun exits 1 on its own SIGTERM; srun may report 0 once SLURM's KillWait ends the step.
    assert last.startswith(
        f"[orch] training stopped on SIGTERM after saving step {record['step']} ("
    ), log[-3000:]
    assert "training exited with status" not in log


def hook_env(run_dir: Path, chain_id: str, job_id: str) -> dict[str, str]:
    """What a batch script of the chain hands its hook (its own job id not in the manifest)."""
    return {
        **os.environ,
        "ORCH_RUN_DIR": str(run_dir),
        "ORCH_CHAIN_ID": chain_id,
        "SLURM_JOB_ID": job_id,
        "PYTHONPATH": str(REPO),
    }


@pytest.mark.slurm
def test_hooks_judging_one_failure_at_once_queue_one_replacement(slurm_cluster, tmp_path):
    """Job 0 dies without its end hook, so whichever hook runs next judges it. Three start hooks
    run at the same moment, as three batch scripts starting together would: the chain lock lets
    one of them judge and replace it, and the others find it judged. Retries are not what stops
    them: three were allowed."""
    recipe = write_sub(tmp_path / "at_once.sub", HOOKED_BODY)  # the jobs' name in the queue
    run_dir = tmp_path / "run"
    summary = launch_json(
        "-n1", "--retries", "3", "--run-dir", str(run_dir), str(recipe), env={"KILL_AT": "0"}
    )
    chain_id = summary["chain_id"]
    assert [job["state"] for job in wait_chain_quietly(run_dir, chain_id, 60)["jobs"]] == ["FAILED"]
    hooks = [
        subprocess.Popen(
            [sys.executable, "-m", "orchestrator.chain_hooks", "start"],
            env=hook_env(run_dir, chain_id, f"9999{n}"),
            stdout=subprocess.PIPE,
            text=True,
        )
        for n in range(3)
    ]
    said = [hook.communicate(timeout=60)[0] for hook in hooks]
    assert [hook.returncode for hook in hooks] == [0, 0, 0], said
    assert sum("to replace job 0: retry 1 of 3" in out for out in said) == 1, said
    assert sum("queued job" in out for out in said) == 1, said
    jobs = manifest_of(run_dir)["jobs"]
    assert [(job["index"], job["replaces"]) for job in jobs] == [(0, None), (1, 0)], jobs
    final = wait_chain_quietly(run_dir, chain_id, timeout=60)
    assert [job["state"] for job in final["jobs"]] == ["FAILED", "COMPLETED"], final
    # SLURM agrees (it keeps ended jobs for MinJobAge): no job of that name beyond the two.
    queued = subprocess.run(
        ["squeue", "--states=all", "--name=at_once", "--noheader", "--format=%i"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.split()
    assert sorted(queued) == sorted(job["job_id"] for job in jobs), queued
    assert (run_dir / "ran").read_text().split()[::2] == ["0", "1"]


def lose_node(directory: Path, node: str, job_id: str) -> None:
    """The node dies under the job, as a power loss would: its slurmd first, then the job's
    slurmstepds (before their children, so none reports the job's end), then what they ran;
    on the loopback cluster killing slurmd alone would leave the job running. slurmctld would
    mark the silent node DOWN within ~15 s (test_cluster_faults.py); told at once, it ends the
    job NODE_FAIL the same way, without that wait."""
    os.kill(daemon_pids(directory)[f"slurmd-{node}"], signal.SIGKILL)
    live = list(processes.live_processes())
    stepds = [p for p in live if f"[{job_id}." in " ".join(processes.command_line(p.pid))]
    tasks = [p for p in live if processes.environment(p).get("SLURM_JOB_ID") == job_id]
    for process in [*stepds, *tasks]:
        with contextlib.suppress(psutil.Error):
            process.kill()
    down = ["scontrol", "update", f"nodename={node}", "state=down", "reason=lost in a test"]
    subprocess.run(down, check=True, timeout=30)


@pytest.mark.slurm
@pytest.mark.slow
def test_a_node_lost_under_a_two_node_step_is_replaced_although_the_job_saved(
    slurm_cluster, tmp_path, corpus
):
    """A 2-node job (a rank per node) loses its second node's slurmd mid-training. SLURM ends
    the job (Reason=NodeDown) and signals its step: the surviving rank saves and exits 0, and
    the end hook on the first node judges the job cut short by the cluster, not stopped, so the
    replacement under --retries 1 trains to max_steps (issue 39: the chain ended incomplete)."""
    recipe = (REPO / "recipes/train_tiny_fsdp2.yaml").read_text()
    two_nodes = tmp_path / "two_nodes.yaml"
    two_nodes.write_text(
        recipe.replace("\nnodes: 1\n", "\nnodes: 2\n").replace(
            "\ntasks_per_node: 2\n", "\ntasks_per_node: 1\n"
        )
    )
    run_dir = tmp_path / "run"
    summary = tiny_training_chain(
        run_dir,
        corpus,
        1,
        1,
        "train.max_steps=40",
        "checkpoint.interval=4",
        NO_WANDB,
        recipe=str(two_nodes),
    )
    chain_id, job0 = summary["chain_id"], summary["jobs"][0]["job_id"]
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoints" / "step_4" / "COMPLETE").exists():
        assert time.monotonic() < deadline, "job 0 saved no checkpoint"
        time.sleep(0.1)
    nodes = subprocess.run(
        ["scontrol", "show", "hostnames", slurm_nodes(job0)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.split()
    try:
        os.kill(daemon_pids(slurm_cluster.directory)[f"slurmd-{nodes[1]}"], signal.SIGKILL)
        down = ["scontrol", "update", f"nodename={nodes[1]}", "state=down", "reason=lost"]
        subprocess.run(down, check=True, timeout=30)
        deadline = time.monotonic() + 120
        while manifest_of(run_dir)["jobs"][0]["outcome"] is None:
            assert time.monotonic() < deadline, "job 0 was not judged"
            time.sleep(0.5)
    finally:
        again = cluster_cli("up", "--dir", str(slurm_cluster.directory))
    assert again.returncode == 0, again.stderr
    final = wait_chain_quietly(run_dir, chain_id, timeout=240)
    assert [job["state"] for job in final["jobs"]] == ["NODE_FAIL", "COMPLETED"], final
    manifest = manifest_of(run_dir)
    jobs = manifest["jobs"]
    assert manifest["status"] == "complete", manifest
    assert [(job["outcome"], job["replaces"]) for job in jobs] == [
        ("failed", None),
        ("finished", 0),
    ]
    assert jobs[1]["reason"].startswith("cut short by the cluster (NODE_FAIL) after saving step")
    saved = int(jobs[1]["reason"].rsplit(" ", 1)[1])
    logs = [
        run_tool("orchestrator", "logs", chain_id, "--job", str(index)).stdout for index in (0, 1)
    ]
    assert "to replace job 0: retry 1 of 1" in logs[0], logs[0][-3000:]
    # A node SLURM has declared lost is never launched on again in place.
    assert "is not restarted in place: the cluster ended the job (NODE_FAIL)" in logs[0]
    assert resumed_from(run_dir, saved) in logs[1]
    assert max(json.loads(line).get("step", 0) for line in metrics_lines(run_dir)) == 40


def slurm_nodes(job_id: str) -> str:
    """The node list SLURM gave a running job."""
    done = subprocess.run(
        ["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True, timeout=30
    )
    return done.stdout.strip()


def metrics_lines(run_dir: Path) -> list[str]:
    return (run_dir / "metrics.jsonl").read_text().splitlines()


def newest_complete(run_dir: Path) -> int:
    steps = [int(p.parent.name[5:]) for p in (run_dir / "checkpoints").glob("step_*/COMPLETE")]
    return max(steps)


def resumed_from(run_dir: Path, step: int) -> str:
    """The trainer's log line on resuming from checkpoint ``step`` of the run dir."""
    return f"resumed from {run_dir / 'checkpoints' / f'step_{step}'} at step {step}"


@pytest.mark.slurm
@pytest.mark.slow
def test_a_training_job_whose_node_fails_is_replaced(slurm_cluster, tmp_path, corpus):
    """Job 0's node dies mid-training (its batch shell with it, so no end hook runs). SLURM ends
    it NODE_FAIL; job 1, started by afterany on the other node, resumes from the newest complete
    checkpoint and, judging job 0 at its start, queues one replacement; that resumes from job 1's
    last save and finishes the training (8 steps, at most 4 per job)."""
    run_dir = tmp_path / "run"
    summary = tiny_training_chain(
        run_dir,
        corpus,
        2,
        1,
        "train.max_steps=8",
        "train.max_steps_per_run=4",
        "checkpoint.interval=2",
        NO_WANDB,
    )
    chain_id, job0 = summary["chain_id"], summary["jobs"][0]["job_id"]
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoints" / "step_2" / "COMPLETE").exists():
        assert time.monotonic() < deadline, "job 0 saved no checkpoint"
        time.sleep(0.1)
    node = slurm_nodes(job0)
    try:
        lose_node(slurm_cluster.directory, node, job0)
        resumed = newest_complete(run_dir)
        assert resumed < 4, "job 0 ended its budget before its node was lost"
        final = wait_chain_quietly(run_dir, chain_id, timeout=240)
    finally:
        again = cluster_cli("up", "--dir", str(slurm_cluster.directory))
    assert again.returncode == 0 and f"restarting slurmd-{node};" in again.stderr, again.stderr
    assert [job["state"] for job in final["jobs"]] == ["NODE_FAIL", "COMPLETED", "COMPLETED"]
    manifest = manifest_of(run_dir)
    jobs = manifest["jobs"]
    assert manifest["status"] == "complete", manifest
    assert [(job["outcome"], job["replaces"]) for job in jobs] == [
        ("failed", None),
        ("stopped", None),
        ("finished", 0),
    ]
    assert jobs[2]["reason"] == "cut short by the cluster (NODE_FAIL)"
    assert jobs[2]["dependency"] == f"afterany:{jobs[1]['job_id']}"
    logs = [
        run_tool("orchestrator", "logs", chain_id, "--job", str(index)).stdout for index in (1, 2)
    ]
    assert resumed_from(run_dir, resumed) in logs[0]
    assert "to replace job 0: retry 1 of 1" in logs[0]
    assert [log.count("[orch] chain: queued job") for log in logs] == [1, 0]
    assert resumed_from(run_dir, resumed + 4) in logs[1]
    status = run_tool("orchestrator", "status", chain_id).stdout
    assert "complete" in status.splitlines()[0], status
    assert "replaces job 0 (cut short by the cluster (NODE_FAIL))" in status, status
