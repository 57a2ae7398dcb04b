"""Chains on the real loopback SLURM cluster, driven through the auto_launch command line."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from orchestrator.manifest import JOURNAL_NAME, MANIFEST_NAME, Manifest
from tests.harness.chains import launch_json, wait_chain, write_sub
from tests.harness.cluster import queue_ids, wait_gone
from tests.harness.process import BIN, run_tool
from tests.harness.recorded_jobs import check_then_job_records, recipes

pytestmark = pytest.mark.slurm

ORDER_BODY = """
echo "start $ORCH_JOB_INDEX $SEED $(date +%s.%N) $SLURM_JOB_ID" >> "$ORCH_RUN_DIR/order.log"
sleep 2
echo "args: $*"
echo "end $ORCH_JOB_INDEX $(date +%s.%N)" >> "$ORCH_RUN_DIR/order.log"
if [ "$ORCH_JOB_INDEX" = "${FAIL_AT:-none}" ]; then exit 3; fi
"""


def scontrol_dependency(job_id: str) -> str:
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30
    ).stdout
    fields = dict(word.split("=", 1) for word in out.split() if "=" in word)
    return fields.get("Dependency", "")


def read_order(run_dir: Path) -> list[list[str]]:
    return [line.split() for line in (run_dir / "order.log").read_text().splitlines()]


def test_three_job_chain_runs_in_order_with_its_seeds(slurm_cluster, tmp_path):
    recipe = write_sub(tmp_path / "order.sub", ORDER_BODY)
    run_dir = tmp_path / "run"
    summary = launch_json("-n3", "--run-dir", str(run_dir), str(recipe), "--", "x", "y z")
    jobs = summary["jobs"]
    ids = [job["job_id"] for job in jobs]
    assert summary["run_dir"] == str(run_dir)
    # Dependencies as asked, checked with SLURM's own view while the later jobs wait.
    assert scontrol_dependency(ids[2]).startswith(f"afterany:{ids[1]}")
    assert [job["dependency"] for job in jobs] == [None, f"afterany:{ids[0]}", f"afterany:{ids[1]}"]

    final = wait_chain(summary["chain_id"])
    assert [job["state"] for job in final["jobs"]] == ["COMPLETED"] * 3

    order = read_order(run_dir)
    starts = [row for row in order if row[0] == "start"]
    ends = [row for row in order if row[0] == "end"]
    assert [row[1] for row in starts] == ["0", "1", "2"]
    for index in (1, 2):
        assert float(starts[index][3]) >= float(ends[index - 1][2]), "jobs overlapped"
    seeds = [int(row[2]) for row in starts]
    assert seeds == [job["seed"] for job in jobs]
    assert len(set(seeds)) == 3
    assert [row[4] for row in starts] == ids

    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "submitted"
    assert [job["seed"] for job in manifest["jobs"]] == seeds
    assert [job["job_id"] for job in manifest["jobs"]] == ids
    assert manifest["args"] == ["x", "y z"]
    assert len(manifest["recipe_sha256"]) == 64

    log = run_tool("orchestrator", "logs", summary["chain_id"], "--job", "1")
    assert f"args: {seeds[1]} x y z" in log.stdout


def test_afterany_goes_on_after_a_failure(slurm_cluster, tmp_path):
    recipe = write_sub(tmp_path / "fails.sub", ORDER_BODY)
    run_dir = tmp_path / "run"
    summary = launch_json("-n3", "--run-dir", str(run_dir), str(recipe), env={"FAIL_AT": "1"})
    final = wait_chain(summary["chain_id"])
    assert [job["state"] for job in final["jobs"]] == ["COMPLETED", "FAILED", "COMPLETED"]
    assert [row[1] for row in read_order(run_dir) if row[0] == "start"] == ["0", "1", "2"]


def test_afterok_stops_the_rest_after_a_failure(slurm_cluster, tmp_path):
    recipe = write_sub(tmp_path / "fails.sub", ORDER_BODY)
    run_dir = tmp_path / "run"
    summary = launch_json(
        "-n3",
        "--dependency",
        "afterok",
        "--run-dir",
        str(run_dir),
        str(recipe),
        env={"FAIL_AT": "0"},
    )
    final = wait_chain(summary["chain_id"])
    assert final["jobs"][0]["state"] == "FAILED"
    assert [row[1] for row in read_order(run_dir) if row[0] == "start"] == ["0"]
    run_tool("orchestrator", "cancel", summary["chain_id"])
    wait_gone([job["job_id"] for job in summary["jobs"]])


@pytest.mark.parametrize(("backend", "label"), [("slurm", "slurm"), ("submitit", "submitit:slurm")])
def test_then_job_runs_after_the_chain(slurm_cluster, tmp_path, backend, label):
    train, evaluate = recipes(tmp_path)
    run_dir = tmp_path / "run"
    summary = launch_json(
        "-n2", "--backend", backend, "--run-dir", str(run_dir), "--then", str(evaluate), str(train)
    )
    assert summary["backend"] == label
    ids = [job["job_id"] for job in summary["jobs"]]
    assert [job["then"] for job in summary["jobs"]] == [False, False, True]
    assert summary["jobs"][2]["dependency"] == f"afterany:{ids[1]}"

    final = wait_chain(summary["chain_id"])
    assert [job["state"] for job in final["jobs"]] == ["COMPLETED"] * 3
    seeds = [job["seed"] for job in final["jobs"]]
    check_then_job_records(run_dir, summary["chain_id"], seeds, args=[])
    status = run_tool("orchestrator", "status", summary["chain_id"]).stdout.splitlines()
    assert status[-1].split()[:5] == ["2", "(then)", ids[2], str(seeds[2]), "COMPLETED"]
    assert "  code: " in status[0]  # the header line says what the jobs ran


def test_seed_option_reproduces_seeds(slurm_cluster, tmp_path):
    recipe = write_sub(tmp_path / "quick.sub", "true\n")
    first = launch_json("-n2", "--seed", "42", "--run-dir", str(tmp_path / "a"), str(recipe))
    second = launch_json("-n2", "--seed", "42", "--run-dir", str(tmp_path / "b"), str(recipe))
    assert [j["seed"] for j in first["jobs"]] == [j["seed"] for j in second["jobs"]]
    wait_chain(first["chain_id"])
    wait_chain(second["chain_id"])


def test_status_list_cancel(slurm_cluster, tmp_path):
    recipe = write_sub(tmp_path / "long.sub", "sleep 60\n")
    summary = launch_json("-n3", "--run-dir", str(tmp_path / "run"), str(recipe))
    chain = summary["chain_id"]
    listing = run_tool("orchestrator", "list")
    assert chain in listing.stdout
    status = run_tool("orchestrator", "status", chain)
    assert status.returncode == 0 and "PENDING" in status.stdout
    cancelled = run_tool("orchestrator", "cancel", chain)
    assert cancelled.returncode == 0, cancelled.stderr
    final = wait_chain(chain)
    assert {job["state"] for job in final["jobs"]} == {"CANCELLED"}
    wait_gone([job["job_id"] for job in summary["jobs"]])


def test_a_launch_killed_halfway_leaves_every_queued_job_on_record(slurm_cluster, tmp_path):
    """The shell dies while auto_launch -n200 submits (ssh dropped, the OOM killer): every job it
    queued must be on record, so that `orchestrator cancel` stops them all."""
    recipe = write_sub(tmp_path / "killed.sub", "sleep 60\n")
    run_dir = tmp_path / "run"
    launch = subprocess.Popen(
        [str(BIN / "auto_launch"), "-n200", "--run-dir", str(run_dir), str(recipe)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    journal = run_dir / JOURNAL_NAME
    deadline = time.monotonic() + 60
    while not journal.exists() or journal.read_text().count("\n") < 5:
        assert launch.poll() is None and time.monotonic() < deadline, "the launch never started"
        time.sleep(0.02)
    launch.kill()
    launch.wait()
    with open(journal, "a") as handle:  # as if the kill had come in the middle of a write
        handle.write('{"index": 999, "seed": 1, "job_')
    manifest = Manifest.load(run_dir / MANIFEST_NAME)
    recorded = manifest.job_ids()
    assert manifest.status == "submitting"
    assert len(recorded) >= 5 and len(set(recorded)) == len(recorded)
    assert [job.index for job in manifest.jobs] == list(range(len(recorded)))
    queued = subprocess.run(
        ["squeue", "--noheader", "--name=killed", "--format=%i"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout.split()
    # sbatch may have answered just before the kill, with the record not yet written.
    unrecorded = set(queued) - set(recorded)
    assert set(recorded) <= set(queued) and len(unrecorded) <= 1
    cancelled = run_tool("orchestrator", "cancel", manifest.chain_id)
    assert cancelled.returncode == 0, cancelled.stderr
    subprocess.run(["scancel", *unrecorded], check=False)
    wait_gone(queued)


def test_dry_run_submits_nothing(slurm_cluster, tmp_path):
    recipe = write_sub(tmp_path / "dry.sub", "true\n")
    before = queue_ids()
    run_dir = tmp_path / "run"
    completed = run_tool("auto_launch", "-n3", "--dry-run", "--run-dir", str(run_dir), str(recipe))
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.count("sbatch --parsable") == 3
    assert "--dependency=afterany:" in completed.stdout
    assert "sbatch --test-only: accepted" in completed.stdout
    assert "SEED=${1:?" in completed.stdout
    assert queue_ids() == before
    assert not run_dir.exists()


@pytest.mark.parametrize("then", [False, True], ids=["chain", "then"])
def test_failed_submission_rolls_back_the_chain(slurm_cluster, tmp_path, then):
    """sbatch accepts job 0 and 1, then refuses job 2 (of the chain, or its --then job): the two
    queued jobs must be cancelled."""
    recipe = write_sub(tmp_path / "slow.sub", "sleep 30\n")
    options = ["-n4"]
    if then:
        options = ["-n2", "--then", str(write_sub(tmp_path / "evaluate.sub", "true\n"))]
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    real_sbatch = subprocess.run(["which", "sbatch"], capture_output=True, text=True).stdout.strip()
    counter = tmp_path / "count"
    # A wrapper around the real sbatch that fails on its third call, as a full queue would.
    (fake_bin / "sbatch").write_text(
        "#!/bin/bash\n"
        f"n=$(cat {counter} 2>/dev/null || echo 0); echo $((n+1)) > {counter}\n"
        'if [ "$n" = 2 ]; then echo "sbatch: error: QOSMaxSubmitJobPerUserLimit" >&2; exit 1; fi\n'
        f'exec {real_sbatch} "$@"\n'
    )
    (fake_bin / "sbatch").chmod(0o755)
    run_dir = tmp_path / "run"
    completed = run_tool(
        "auto_launch",
        *options,
        "--run-dir",
        str(run_dir),
        str(recipe),
        env={"PATH": f"{fake_bin}:{os.environ['PATH']}"},
    )
    assert completed.returncode == 1
    assert "QOSMaxSubmitJobPerUserLimit" in completed.stderr
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "rolled_back"
    submitted = [job["job_id"] for job in manifest["jobs"]]
    assert len(submitted) == 2
    wait_gone(submitted)
