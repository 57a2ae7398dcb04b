"""The demo job run for real, without SLURM: recipes/smoke.sub and the rendered smoke.yaml under
plain bash, with torch.distributed (gloo) ranks, the seed contract and USR1 forwarding."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.scripts import prepare_script
from tests.harness.process import REPO


def job_env(run_dir: Path, seed: int) -> dict[str, str]:
    """What auto_launch hands a job: the ORCH_* contract, and the project's Python on PATH."""
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "OMP_NUM_THREADS": "1",
        "ORCH_CHAIN_ID": "test-chain",
        "ORCH_JOB_INDEX": "3",
        "ORCH_NUM_JOBS": "5",
        "ORCH_SEED": str(seed),
        "ORCH_RUN_DIR": str(run_dir),
    }


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "smoke.jsonl").read_text().splitlines()]


def signal_when_training(
    script: Path, run_dir: Path, seed: int, early: bool = False, args: tuple[str, ...] = ()
) -> tuple[int, str]:
    """Start ``bash script seed``, send it USR1 once the ranks report in (or, ``early``, as soon
    as the batch shell has started, before any rank exists); (exit code, output)."""
    job = subprocess.Popen(
        ["bash", str(script), str(seed), *args],
        cwd=REPO,
        env=job_env(run_dir, seed),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = []
    try:
        for line in job.stdout:
            output.append(line)
            # The summary comes after every rank has installed its signal handlers; the job header
            # before any rank has started.
            if line.startswith("[orch] job" if early else "smoke: job index") or (
                early and line.startswith("[smoke] job")
            ):
                job.send_signal(signal.SIGUSR1)
                break
        output.append(job.stdout.read())
        return job.wait(timeout=45), "".join(output)
    finally:
        if job.poll() is None:
            job.kill()


@pytest.mark.timeout(60)
def test_smoke_sub_runs_two_ranks_with_distinct_data_seeds(tmp_path: Path) -> None:
    completed = subprocess.run(
        ["bash", "recipes/smoke.sub", "1234", "--steps", "2", "--sleep", "0.1"],
        cwd=REPO,
        env=job_env(tmp_path, 1234),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "smoke: job index 3 seed 1234 world size 2: rank 0" in completed.stdout
    (record,) = records(tmp_path)
    assert (record["job_index"], record["seed"], record["world_size"]) == (3, 1234, 2)
    assert len(set(record["data_seeds"])) == 2
    assert (record["steps_done"], record["stopped_on_signal"]) == (2, False)


def test_smoke_sub_refuses_to_run_without_a_seed(tmp_path: Path) -> None:
    completed = subprocess.run(
        ["bash", "recipes/smoke.sub"],
        cwd=REPO,
        env=job_env(tmp_path, 1),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert completed.returncode == 2
    assert "give the job's seed" in completed.stderr
    assert not (tmp_path / "smoke.jsonl").exists()


@pytest.mark.timeout(60)
def test_smoke_sub_forwards_usr1_to_the_ranks_past_torchrun(tmp_path: Path) -> None:
    code, output = signal_when_training(REPO / "recipes" / "smoke.sub", tmp_path, 77)
    assert code == 0, output
    assert "stopping at step" in output
    (record,) = records(tmp_path)
    assert record["stopped_on_signal"] is True
    assert record["world_size"] == 2
    assert record["steps_done"] < 20


@pytest.mark.timeout(60)
def test_rendered_single_template_forwards_usr1_to_the_training(tmp_path: Path) -> None:
    script = tmp_path / "smoke.sub"
    script.write_text(prepare_script(REPO / "recipes" / "smoke.yaml").text)
    code, output = signal_when_training(script, tmp_path, 5)
    assert code == 0, output
    assert "[orch] training exited with status 0" in output
    (record,) = records(tmp_path)
    assert (record["seed"], record["world_size"], record["stopped_on_signal"]) == (5, 1, True)
    assert record["steps_done"] < 20


@pytest.mark.timeout(90)
@pytest.mark.parametrize("recipe", ["smoke.sub", "smoke.yaml"])
def test_usr1_before_the_ranks_exist_is_not_lost(recipe: str, tmp_path: Path) -> None:
    """SLURM's limit check is coarse: USR1 can come as the job starts. It must still stop the
    training cleanly (the batch shell keeps passing it on until the ranks act on it)."""
    script = REPO / "recipes" / recipe
    if recipe.endswith(".yaml"):
        script = tmp_path / "smoke.sub"
        script.write_text(prepare_script(REPO / "recipes" / recipe).text)
    code, output = signal_when_training(
        script, tmp_path, 9, early=True, args=("--steps", "200", "--sleep", "0.2")
    )
    assert code == 0, output
    (record,) = records(tmp_path)
    assert record["stopped_on_signal"] is True, output
    assert record["steps_done"] < 200
