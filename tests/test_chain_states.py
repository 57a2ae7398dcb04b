"""Every chain says how it ended, on every backend, and the cause is where the user looks.

Which real runs these catch: a local chain whose trainer refused its config that ran every
planned job, exited 0 and read ``submitted`` forever; a SLURM chain of a .sub without the chain
hook whose jobs all completed and still read ``submitted``; a failure whose only trace was
torchrun's 40-line traceback; a chain with a missing corpus queued anyway, to fail in the job.

The local chains run a stand-in trainer (tests/harness/chains.py) that writes the end-of-job
record as the trainer does; one chain runs the real trainer, refusing a missing corpus.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contract.job_end import EXIT_CONFIG, EXIT_PEER_LOST
from orchestrator.backends.submitit_local import SubmititLocalBackend
from orchestrator.errors import EXIT_CHAIN_FAILED, UsageError
from orchestrator.launch import site_for
from orchestrator.launch_checks import check_backend_retries
from orchestrator.manifest import (
    BLOCKED,
    CANCELLED,
    COMPLETE,
    FAILED,
    INCOMPLETE,
    QUEUED,
    RUNNING,
)
from tests.harness.chains import STAND_IN_TRAINER, launch_json, wait_chain, write_sub
from tests.harness.process import REPO, run_tool

MISSING = "data: /nowhere/cuts_train.jsonl.gz does not exist"
# The first run of a job fails as a lost peer does (exit 6), every later one finishes.
FLAKY_ONCE = f"""
n=$(cat "$ORCH_RUN_DIR/runs" 2>/dev/null || echo 0)
echo $((n + 1)) > "$ORCH_RUN_DIR/runs"
if [ "$n" = 0 ]; then CODE={EXIT_PEER_LOST}; fi
{STAND_IN_TRAINER}"""


def local_chain(tmp_path: Path, body: str, jobs: int, *args: str, **env: str):
    """``auto_launch`` of a .sub running ``body`` on the local backend: the completed process
    and the chain's run dir."""
    run_dir = tmp_path / "run"
    recipe = write_sub(tmp_path / "trainer.sub", body)
    done = run_tool(
        "auto_launch", f"-n{jobs}", "--backend", "local", "--run-dir", str(run_dir), *args,
        str(recipe),
        env=env,
    )  # fmt: skip
    return done, run_dir


def status_of(run_dir: Path) -> dict:
    done = run_tool("orchestrator", "status", str(run_dir), "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def listed_status(chain_id: str) -> str:
    done = run_tool("orchestrator", "list")
    assert done.returncode == 0, done.stderr
    (row,) = [line.split() for line in done.stdout.splitlines() if line.startswith(chain_id)]
    return row[3]


# the local backend: judged as each job ends --------------------------------------------------


@pytest.mark.parametrize(
    ("env", "jobs", "status", "code", "ran"),
    [
        ({"CODE": "0", "SAVE": "8"}, 2, COMPLETE, 0, 1),  # finished: the next job is not run
        ({"CODE": "0", "SAVE": "5"}, 2, INCOMPLETE, 0, 2),  # saved, training unfinished
        ({"CODE": str(EXIT_CONFIG), "ERROR": MISSING}, 3, BLOCKED, EXIT_CHAIN_FAILED, 1),
        ({"CODE": "1", "ERROR": "ValueError: bad batch"}, 1, FAILED, EXIT_CHAIN_FAILED, 1),
    ],
    ids=["complete", "incomplete", "blocked", "failed"],
)
def test_a_local_chain_ends_as_its_trainer_says(tmp_path, env, jobs, status, code, ran):
    done, run_dir = local_chain(tmp_path, STAND_IN_TRAINER, jobs, **env)
    assert done.returncode == code, done.stderr + done.stdout
    assert done.stdout.strip().splitlines()[-1].startswith(f"{status}: "), done.stdout
    found = status_of(run_dir)
    assert found["status"] == status and len(found["jobs"]) == ran, found
    assert listed_status(found["chain_id"]) == status
    assert all(job["elapsed"].count(":") == 2 for job in found["jobs"]), found["jobs"]
    if "ERROR" in env:  # the trainer's line, where the user looks, and its own exit status
        said = f"error: {env['ERROR']}"
        assert f"FAILED (exit {env['CODE']}) after" in done.stderr and said in done.stderr
        assert said in found["ended"] and said in found["jobs"][-1]["reason"], found
        assert found["jobs"][-1]["exit_code"] == int(env["CODE"])
        logs = run_tool("orchestrator", "logs", str(run_dir), "--job", str(ran - 1))
        assert logs.stdout.strip().splitlines()[-1].endswith(f"error: {env['ERROR']} <==")
    if status == BLOCKED:  # the planned jobs after it never ran
        assert found["ended"].endswith(f"; {jobs - 1} more planned job(s) not run"), found


def test_a_local_chain_retries_a_failed_job_at_once(tmp_path):
    """Under --retries the replacement runs right after the failed job (a new index, the seed
    the chain's sequence gives it), and finishing it completes the chain."""
    done, run_dir = local_chain(
        tmp_path, FLAKY_ONCE, 2, "--retries", "1", "--seed", "5", CODE="0", SAVE="8"
    )
    assert done.returncode == 0, done.stderr + done.stdout
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == COMPLETE, manifest
    jobs = [(job["index"], job["outcome"], job["replaces"]) for job in manifest["jobs"]]
    assert jobs == [(0, "failed", None), (2, "finished", 0)], manifest["jobs"]
    assert "a rank lost a peer" in manifest["jobs"][1]["reason"]


def test_retries_need_a_backend_whose_chains_are_judged():
    with pytest.raises(UsageError, match="needs the slurm or local backend"):
        check_backend_retries(1, site_for(SubmititLocalBackend).backend)


def test_the_trainers_refusal_is_the_line_the_user_sees(tmp_path):
    """The real trainer under torchrun, refusing a missing corpus (the plan check skipped, as
    a config that passed it but not the trainer would be): its line, not torchrun's traceback,
    on the [local] line and in status; the chain blocked after one job; auto_launch exits 3."""
    run_dir = tmp_path / "run"
    done = run_tool(
        "auto_launch", "-n2", "--backend", "local", "--no-plan-check", "--run-dir", str(run_dir),
        "recipes/train_tiny_fsdp2.yaml", "--", "data.corpus=/nowhere", "wandb.mode=offline",
        cwd=REPO,
    )  # fmt: skip
    assert done.returncode == EXIT_CHAIN_FAILED, done.stderr + done.stdout
    line = [row for row in done.stderr.splitlines() if "FAILED (exit" in row]
    assert len(line) == 1 and f"error: {MISSING}; make the corpus" in line[0], done.stderr
    found = status_of(run_dir)
    assert found["status"] == BLOCKED and len(found["jobs"]) == 1, found
    assert found["jobs"][0]["exit_code"] == EXIT_CONFIG  # the trainer's, not torchrun's 1
    assert f"error: {MISSING}" in found["jobs"][0]["reason"]


# preflight: the data the config names ----------------------------------------------------------


@pytest.mark.parametrize("what", ["corpus", "source"])
def test_missing_data_is_refused_before_anything_is_queued(tmp_path, what):
    if what == "corpus":
        override, expected = "data.corpus=/nowhere", f"{MISSING}; make the corpus with"
    else:
        sources = tmp_path / "sources.yaml"
        sources.write_text("- cuts: /nowhere/cuts.jsonl.gz\n")
        override = f"data.input_cfg={sources}"
        expected = f"data.input_cfg={sources}: source 0: /nowhere/cuts.jsonl.gz does not exist"
    run_dir = tmp_path / "run"
    done = run_tool(
        "auto_launch", "-n2", "--backend", "local", "--run-dir", str(run_dir),
        "recipes/train_tiny_fsdp2.yaml", "--", override,
        cwd=REPO,
    )  # fmt: skip
    assert done.returncode == UsageError.exit_code, done.stderr
    (error,) = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert expected in error and "train_tiny_fsdp2.yaml" in error, done.stderr
    assert not run_dir.exists()


# SLURM: chains whose jobs never judge -----------------------------------------------------------


@pytest.mark.slurm
@pytest.mark.parametrize(
    ("body", "status", "why"),
    [
        ("echo hello\n", COMPLETE, "the last, completed"),
        ("exit 3\n", FAILED, "the last, ended FAILED (exit 3)"),
    ],
    ids=["complete", "failed"],
)
def test_a_chain_without_the_hook_reads_how_its_jobs_ended(
    empty_queue, tmp_path, body, status, why
):
    recipe = write_sub(tmp_path / "plain.sub", body)
    summary = launch_json("-n2", "--run-dir", str(tmp_path / "run"), str(recipe))
    assert summary["status"] in (QUEUED, RUNNING), summary
    final = wait_chain(summary["chain_id"], timeout=60)
    assert final["status"] == status and why in final["ended"], final
    assert listed_status(summary["chain_id"]) == status


@pytest.mark.slurm
def test_a_cancelled_chain_reads_cancelled(empty_queue, tmp_path):
    recipe = write_sub(tmp_path / "long.sub", "sleep 120\n")
    summary = launch_json("-n2", "--run-dir", str(tmp_path / "run"), str(recipe))
    cancelled = run_tool("orchestrator", "cancel", summary["chain_id"])
    assert cancelled.returncode == 0, cancelled.stderr
    final = wait_chain(summary["chain_id"], timeout=60)
    assert final["status"] == CANCELLED, final
    assert listed_status(summary["chain_id"]) == CANCELLED
