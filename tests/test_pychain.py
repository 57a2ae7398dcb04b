"""A chain of Python callables through submitit keeps the auto_launch chain's record and order."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import cloudpickle
import pytest

from orchestrator.errors import UsageError
from orchestrator.pychain import launch_callable_chain
from tests.harness.chains import chain_status, wait_chain
from tests.harness.process import run_tool

# The jobs unpickle this module's functions by value: they need not import the tests package.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def note_job(seed: int, out: str) -> int:
    print(f"note_job ran with seed {seed}", flush=True)
    with open(out, "a") as handle:
        handle.write(json.dumps({"seed": seed, "index": os.environ["ORCH_JOB_INDEX"]}) + "\n")
    return seed


def test_local_callable_chain(tmp_path):
    out = tmp_path / "jobs.jsonl"
    manifest = launch_callable_chain(
        note_job, 3, args=(str(out),), run_dir=tmp_path / "run", seed=5, cluster="local"
    )
    assert manifest.status == "submitted"
    assert manifest.backend == "submitit:local"
    assert manifest.script.endswith("note_job")
    final = wait_chain(manifest.chain_id, timeout=120)
    assert [job["state"] for job in final["jobs"]] == ["COMPLETED"] * 3
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["index"] for line in lines] == ["0", "1", "2"]
    assert [line["seed"] for line in lines] == [job.seed for job in manifest.jobs]
    saved = json.loads((Path(manifest.run_dir) / "manifest.json").read_text())
    assert [job["seed"] for job in saved["jobs"]] == [line["seed"] for line in lines]
    assert chain_status(manifest.chain_id)["backend"] == "submitit:local"
    logs = run_tool("orchestrator", "logs", manifest.chain_id, "--job", "2").stdout
    assert f"note_job ran with seed {manifest.jobs[2].seed}" in logs


@pytest.mark.slurm
def test_slurm_callable_chain(slurm_cluster, tmp_path):
    out = tmp_path / "jobs.jsonl"
    manifest = launch_callable_chain(
        note_job,
        2,
        args=(str(out),),
        run_dir=tmp_path / "run",
        cluster="slurm",
        executor_params={"time": 5},
    )
    assert manifest.jobs[1].dependency == f"afterany:{manifest.jobs[0].job_id}"
    final = wait_chain(manifest.chain_id, timeout=120)
    assert [job["state"] for job in final["jobs"]] == ["COMPLETED"] * 2
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["index"] for line in lines] == ["0", "1"]


def test_callable_chain_bad_input(tmp_path):
    with pytest.raises(UsageError, match="at least 1"):
        launch_callable_chain(note_job, 0, run_dir=tmp_path / "run", cluster="local")
    with pytest.raises(UsageError, match="not callable"):
        launch_callable_chain("note_job", 2, run_dir=tmp_path / "run", cluster="local")
    assert not (tmp_path / "run").exists()


def test_callable_chain_asking_for_gpus_this_machine_lacks_is_refused(tmp_path):
    """The Python API runs auto_launch's resource checks: submitit's own GPU request on a
    machine with none would queue jobs that fail at start."""
    with pytest.raises(UsageError, match="asks for GPUs and this machine has none"):
        launch_callable_chain(
            note_job,
            2,
            args=(str(tmp_path / "out"),),
            run_dir=tmp_path / "run",
            cluster="local",
            executor_params={"gpus_per_node": 1},
        )
    assert not (tmp_path / "run").exists()


@pytest.mark.slurm
@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"partition": "nope"}, "partition 'nope' does not exist"),
        ({"cpus_per_task": 64}, "1 tasks x 64 CPUs per node asked"),
        ({"nodes": 9}, "9 nodes asked"),
    ],
    ids=["partition", "cpus", "nodes"],
)
def test_callable_chain_that_cannot_fit_the_cluster_queues_nothing(
    empty_queue, tmp_path, params, message
):
    with pytest.raises(UsageError, match=message):
        launch_callable_chain(
            note_job,
            2,
            args=(str(tmp_path / "out"),),
            run_dir=tmp_path / "run",
            cluster="slurm",
            executor_params={"time": 5, **params},
        )
    assert empty_queue.queue_job_ids() == []
    assert not (tmp_path / "run").exists()
