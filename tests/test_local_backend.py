"""The local backend runs a recipe unchanged, with the .sub contract emulated for one node."""

from __future__ import annotations

from pathlib import Path

from orchestrator.errors import EXIT_CHAIN_FAILED
from orchestrator.manifest import FAILED
from tests.harness.chains import launch_json, write_sub
from tests.harness.process import run_tool
from tests.harness.recorded_jobs import read_jsonl

ENV_BODY = """
python3 - "$@" <<'PY' >> "$ORCH_RUN_DIR/env.jsonl"
import json, os, sys
keys = sorted(k for k in os.environ if k.startswith(("ORCH_", "SLURM_")))
print(json.dumps({"argv": sys.argv[1:], "env": {k: os.environ[k] for k in keys}}))
PY
srun --ntasks=2 bash -c 'echo "task $SLURM_PROCID of $SLURM_NTASKS" >> "$ORCH_RUN_DIR/tasks.log"'
if [ "$ORCH_JOB_INDEX" = "${FAIL_AT:-none}" ]; then exit 4; fi
"""


def test_local_chain_keeps_the_contract(tmp_path):
    recipe = write_sub(tmp_path / "env.sub", ENV_BODY)
    run_dir = tmp_path / "run"
    summary = launch_json(
        "-n3",
        "--backend",
        "local",
        "--seed",
        "9",
        "--run-dir",
        str(run_dir),
        str(recipe),
        "--",
        "a b",
        "$(touch /tmp/orch-injected)",
    )
    assert [job["state"] for job in summary["jobs"]] == ["COMPLETED"] * 3
    records = read_jsonl(run_dir / "env.jsonl")
    assert [r["env"]["ORCH_JOB_INDEX"] for r in records] == ["0", "1", "2"]
    seeds = [job["seed"] for job in summary["jobs"]]
    assert [int(r["argv"][0]) for r in records] == seeds
    assert [int(r["env"]["ORCH_SEED"]) for r in records] == seeds
    assert all(r["argv"][1:] == ["a b", "$(touch /tmp/orch-injected)"] for r in records)
    assert not Path("/tmp/orch-injected").exists()
    first = records[0]["env"]
    assert first["ORCH_CHAIN_ID"] == summary["chain_id"]
    assert first["ORCH_NUM_JOBS"] == "3"
    assert first["ORCH_RUN_DIR"] == str(run_dir)
    assert first["SLURM_NNODES"] == "1" and first["SLURM_NODEID"] == "0"
    assert first["SLURM_JOB_ID"].isdigit()
    assert len({r["env"]["SLURM_JOB_ID"] for r in records}) == 3
    tasks = (run_dir / "tasks.log").read_text().splitlines()
    assert sorted(tasks) == sorted(["task 0 of 2", "task 1 of 2"] * 3)
    logs = sorted((run_dir / "logs").glob("env-*.out"))
    assert len(logs) == 3


def test_local_afterok_stops_after_a_failure(tmp_path):
    """The chain ends failed, on its job that failed, and auto_launch says so (exit 3)."""
    recipe = write_sub(tmp_path / "env.sub", ENV_BODY)
    summary = launch_json(
        "-n3", "--backend", "local", "--dependency", "afterok", "--run-dir", str(tmp_path / "run"),
        str(recipe),
        env={"FAIL_AT": "1"}, exit_code=EXIT_CHAIN_FAILED,
    )  # fmt: skip
    assert [job["state"] for job in summary["jobs"]] == ["COMPLETED", "FAILED", "CANCELLED"]
    assert summary["status"] == FAILED
    status = run_tool("orchestrator", "status", summary["chain_id"])
    assert "DependencyNeverSatisfied" in status.stdout
    assert "failed: job 1 (id " in status.stdout
    assert "the last that ran, exited with status 4" in status.stdout


def test_local_signal_arrives_before_the_time_limit(tmp_path):
    """--signal=B:USR1@8 with --time=0:15 reaches the batch shell ~7 s in; it exits 0 on it."""
    body = """
    trap 'echo "got USR1" >> "$ORCH_RUN_DIR/signal.log"; exit 0' USR1
    for _ in $(seq 60); do sleep 0.5; done
    echo "never signalled" >> "$ORCH_RUN_DIR/signal.log"
    """
    recipe = write_sub(
        tmp_path / "sig.sub", body, directives="#SBATCH --time=0:15\n#SBATCH --signal=B:USR1@8"
    )
    run_dir = tmp_path / "run"
    summary = launch_json("-n1", "--backend", "local", "--run-dir", str(run_dir), str(recipe))
    assert summary["jobs"][0]["state"] == "COMPLETED"
    assert (run_dir / "signal.log").read_text().strip() == "got USR1"


def test_local_time_limit_ends_the_job(tmp_path):
    """A job its time limit ends before it saved fails the chain: auto_launch exits 3."""
    recipe = write_sub(tmp_path / "slow.sub", "sleep 30\n", directives="#SBATCH --time=0:03")
    summary = launch_json(
        "-n1", "--backend", "local", "--run-dir", str(tmp_path / "r"), str(recipe),
        exit_code=EXIT_CHAIN_FAILED,
    )  # fmt: skip
    assert summary["jobs"][0]["state"] == "TIMEOUT" and summary["status"] == FAILED
