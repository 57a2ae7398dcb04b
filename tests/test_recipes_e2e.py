"""The shipped recipes, run through auto_launch on the loopback cluster and the local backend."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.harness.chains import launch_json, wait_chain
from tests.harness.process import REPO, run_tool

pytestmark = pytest.mark.slurm


def smoke_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "smoke.jsonl").read_text().splitlines()]


def test_two_node_rendezvous(slurm_cluster, tmp_path):
    """Two node daemons, one rank each, meet through torch.distributed (gloo) and all_reduce."""
    run_dir = tmp_path / "run"
    summary = launch_json(
        "-n2",
        "--run-dir",
        str(run_dir),
        "recipes/smoke_2node.yaml",
        "--",
        "--steps",
        "2",
        "--sleep",
        "0.1",
        cwd=REPO,
    )
    final = wait_chain(summary["chain_id"], timeout=240)
    assert [job["state"] for job in final["jobs"]] == ["COMPLETED"] * 2, final
    assert final["jobs"][0]["nodes"] == "n[1-2]"
    records = smoke_records(run_dir)
    assert [record["seed"] for record in records] == [job["seed"] for job in summary["jobs"]]
    for record in records:
        assert record["world_size"] == 2
        assert sorted(rank["node"] for rank in record["ranks"]) == ["0", "1"]
        assert len(set(record["data_seeds"])) == 2
    assert records[0]["data_seeds"] != records[1]["data_seeds"], "new job seed, new data seeds"


@pytest.mark.slow
def test_time_limit_signal_stops_the_ranks_cleanly(slurm_cluster, tmp_path):
    """A 1-minute job asks for USR1 50 s early: the ranks stop at a step boundary and exit 0."""
    recipe = tmp_path / "short.yaml"
    recipe.write_text(
        "template: distributed\nnodes: 2\ntime: '1'\nsignal_grace: 50\n"
        f"command: [python, {REPO / 'recipes/smoke.py'}, --seed, '${{SEED}}', --steps, 400,"
        " --sleep, 0.25]\n"
    )
    run_dir = tmp_path / "run"
    summary = launch_json("-n1", "--run-dir", str(run_dir), str(recipe), cwd=REPO)
    final = wait_chain(summary["chain_id"], timeout=150)
    assert final["jobs"][0]["state"] == "COMPLETED", final
    record = smoke_records(run_dir)[0]
    assert record["stopped_on_signal"] is True
    assert 0 < record["steps_done"] < 400
    log = run_tool("orchestrator", "logs", summary["chain_id"]).stdout
    assert "stopping at step" in log


def test_local_backend_runs_the_same_recipe(tmp_path):
    run_dir = tmp_path / "run"
    summary = launch_json(
        "-n2",
        "--backend",
        "local",
        "--run-dir",
        str(run_dir),
        "recipes/smoke.sub",
        "--",
        "--steps",
        "2",
        "--sleep",
        "0.1",
        cwd=REPO,
    )
    assert [job["state"] for job in summary["jobs"]] == ["COMPLETED"] * 2
    records = smoke_records(run_dir)
    assert [record["seed"] for record in records] == [job["seed"] for job in summary["jobs"]]
    assert all(record["world_size"] == 2 for record in records)
    assert [record["slurm_job_id"] for record in records] == [
        job["job_id"] for job in summary["jobs"]
    ]


def test_usr1_as_the_job_starts_still_stops_it_cleanly(slurm_cluster, tmp_path):
    """SLURM may warn a job as soon as it starts: the request must last until the ranks listen."""
    run_dir = tmp_path / "run"
    summary = launch_json(
        "-n1",
        "--run-dir",
        str(run_dir),
        "recipes/smoke_2node.yaml",
        "--",
        "--steps",
        "400",
        "--sleep",
        "0.2",
        cwd=REPO,
    )
    job_id = summary["jobs"][0]["job_id"]
    # RUNNING in squeue means allocated; a signal before the batch script exists reaches no one.
    # The script prints its header once its trap is in place: signal right then.
    log = run_dir / "logs" / f"smoke_2node-{job_id}.out"
    deadline = time.monotonic() + 60
    while not (log.exists() and "[orch] job" in log.read_text()):
        assert time.monotonic() < deadline, "the job's batch script did not start"
        time.sleep(0.1)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True)
    final = wait_chain(summary["chain_id"], timeout=120)
    assert final["jobs"][0]["state"] == "COMPLETED", final
    record = smoke_records(run_dir)[0]
    assert record["stopped_on_signal"] is True
    assert record["steps_done"] < 400
