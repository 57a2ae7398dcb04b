"""``auto_launch --then RECIPE`` on this machine: one more job after the chain's last, in the same
run dir, with the next index and seed; a bad --then recipe queues nothing.

The same on the loopback cluster is in test_chain_slurm.py, for sweeps in test_sweeps.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contract.seeds import chain_seeds
from orchestrator.errors import EXIT_CHAIN_FAILED
from orchestrator.manifest import FAILED, orch_home
from tests.harness.chains import launch_json, wait_chain, write_sub
from tests.harness.process import run_tool
from tests.harness.recorded_jobs import check_then_job_records, read_jsonl, recipes

# Neither a local nor a submitit chain may find the session's loopback cluster.
NO_SLURM = {"SLURM_CONF": "/dev/null"}  # sinfo fails at once (a missing file: retried for 60 s)


def written(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize(("backend", "label"), [("local", "local"), ("submitit", "submitit:local")])
def test_then_job_follows_the_chain_with_the_contract(tmp_path, backend, label):
    train, evaluate = recipes(tmp_path)
    run_dir = tmp_path / "run"
    summary = launch_json(
        "-n2",
        "--backend",
        backend,
        "--seed",
        "9",
        "--run-dir",
        str(run_dir),
        "--then",
        str(evaluate),
        str(train),
        "--",
        "x",
        "y z",
        env=NO_SLURM,
    )
    assert summary["backend"] == label
    chain = summary["chain_id"]
    final = wait_chain(chain, timeout=120)
    jobs = final["jobs"]
    assert [job["then"] for job in jobs] == [False, False, True]
    assert [job["state"] for job in jobs] == ["COMPLETED"] * 3
    assert jobs[2]["dependency"] == f"afterany:{jobs[1]['job_id']}"
    # The --then job takes the next seed of the chain's sequence; the chain's own are unchanged.
    seeds = [job["seed"] for job in jobs]
    assert seeds == chain_seeds(3, 9) and seeds[:2] == chain_seeds(2, 9)
    # The arguments after -- belong to the chain's recipe: the --then job gets its seed alone.
    check_then_job_records(run_dir, chain, seeds, args=[])

    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["num_jobs"] == 2
    assert manifest["then"]["recipe"] == str(evaluate)
    assert manifest["then"]["script"] == str(run_dir / "then-evaluate.sub")
    assert manifest["jobs"][2]["then"] is True
    status = run_tool("orchestrator", "status", chain)
    assert status.returncode == 0, status.stderr
    last = status.stdout.strip().splitlines()[-1].split()
    assert last[:4] == ["2", "(then)", jobs[2]["job_id"], str(seeds[2])]
    listing = run_tool("orchestrator", "list").stdout.splitlines()
    [row] = [line.split() for line in listing if line.startswith(f"{chain} ")]
    assert row[1:3] == [label, "2+then"], row


def test_then_job_runs_after_a_chain_that_failed(tmp_path):
    """afterok stops the chain at its failure; the --then job still runs (afterany)."""
    train, evaluate = recipes(tmp_path)
    run_dir = tmp_path / "run"
    summary = launch_json(
        "-n2",
        "--backend",
        "local",
        "--dependency",
        "afterok",
        "--run-dir",
        str(run_dir),
        "--then",
        str(evaluate),
        str(train),
        env={**NO_SLURM, "FAIL_AT": "0"},
        exit_code=EXIT_CHAIN_FAILED,
    )
    assert [job["state"] for job in summary["jobs"]] == ["FAILED", "CANCELLED", "COMPLETED"]
    assert summary["status"] == FAILED
    assert summary["jobs"][2]["dependency"] == f"afterany:{summary['jobs'][1]['job_id']}"
    ran = [r["recipe"] for r in read_jsonl(run_dir / "jobs.jsonl")]
    assert ran == ["train", "evaluate"]


@pytest.mark.parametrize(
    ("make_then", "expected"),
    [
        (lambda t: str(t / "missing.yaml"), "recipe {t}/missing.yaml does not exist"),
        (
            lambda t: str(write_sub(t / "two_nodes.sub", "true\n", "#SBATCH --nodes=2")),
            "the recipe asks for 2 nodes",
        ),
        (
            lambda t: written(t / "bad.yaml", "command: [echo]\nnodez: 2\n"),
            "bad.yaml: nodez: unknown field",
        ),
    ],
    ids=["missing", "too-big", "invalid"],
)
def test_a_bad_then_recipe_queues_nothing(tmp_path, make_then, expected):
    train = write_sub(tmp_path / "train.sub", "true\n")
    then = make_then(tmp_path)
    run_dir = tmp_path / "run"
    jobs_dir = orch_home() / "local_jobs"
    before = set(jobs_dir.iterdir()) if jobs_dir.exists() else set()
    done = run_tool(
        "auto_launch",
        "--backend",
        "local",
        "--run-dir",
        str(run_dir),
        "--then",
        str(then),
        str(train),
        env=NO_SLURM,
    )
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith("error: --then: ")
    assert expected.format(t=tmp_path) in errors[0]
    assert not run_dir.exists()
    assert (set(jobs_dir.iterdir()) if jobs_dir.exists() else set()) == before
