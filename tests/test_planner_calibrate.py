"""`orchestrator plan --calibrate`: a user's own measured steps correct the step-time constants
for their cluster (orchestrator/planner/past_runs.py, planner/fit.py): from a table in
measurements.csv's columns, and from a chain's run dir, whose jobs record what ran."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

from contract.run_dir import JOB_STARTS_DIR, METRICS_FILE
from orchestrator.planner.costs import FITTED
from orchestrator.planner.fit import calibrate, prepare
from orchestrator.planner.measured import TABLE, load
from orchestrator.planner.past_runs import job_segments, row_of
from tests.harness.process import run_tool
from tests.harness.training import train

# Llama-3-shaped 70B on 32 H200s in nodes of 4: KempnerForge's cluster (measurements.csv).
K70 = [
    "--llm-only", "--layers", "80", "--hidden", "8192", "--heads", "64", "--kv-heads", "8",
    "--ffn", "28672", "--vocab", "128256", "--seq-len", "4096", "--global-batch", "64",
    "--gpus", "32", "--gpus-per-node", "4", "--gpu", "h200", "--loss-chunk", "0",
]  # fmt: skip
SWEEP_70B = "kempnerforge-h200 70B 32 GPUs"


def table_of(tmp_path: Path, sweep: str) -> Path:
    """The rows of one sweep of measurements.csv, as a user's own table."""
    lines = TABLE.read_text().splitlines()
    header = next(line for line in lines if line.startswith("source,"))
    rows = [line for line in lines if line.endswith(f",{sweep},held_out")]
    assert len(rows) == 3
    path = tmp_path / "mine.csv"
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


def first_choice(*args: str) -> dict:
    done = run_tool("orchestrator", "plan", *K70, "--json", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_your_runs_change_the_first_choice(tmp_path):
    """KempnerForge measured its 70B's 4-stage pipeline 1.4x slower than the published fit
    prices it, beside TP 4 x FSDP 8: calibrated on those three runs the planner stops putting a
    pipeline of 32 one-sequence microbatches first and picks TP x FSDP with larger ones."""
    mine = table_of(tmp_path, SWEEP_70B)
    published = first_choice()
    calibrated = first_choice("--calibrate", str(mine))
    assert published["best"]["layout"]["pp"] > 1
    assert calibrated["best"]["layout"]["pp"] == 1
    assert calibrated["best"]["layout"]["microbatch"] > published["best"]["layout"]["microbatch"]
    assert calibrated["constants"] != published["constants"]
    done = run_tool("orchestrator", "plan", *K70, "--top", "1", "--calibrate", str(mine))
    first = done.stdout.splitlines()[0]
    assert first.startswith("calibrated on 3 measured run(s) of yours: step efficiency")
    before, after = map(float, re.search(r"their error ([\d.]+)% -> ([\d.]+)%", first).groups())
    assert after < before / 4, first


def test_one_or_two_runs_calibrate_the_step_efficiency_alone():
    rows = [prepare(row) for row in load() if row.sweep == SWEEP_70B][:2]
    found = calibrate(rows)
    assert found.constants.step_efficiency != FITTED.step_efficiency
    assert found.constants.microbatch_half_tokens == FITTED.microbatch_half_tokens
    assert found.constants.overlap_exponent == FITTED.overlap_exponent
    assert found.error_after < found.error_before


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("missing.csv", "--calibrate {tmp}/missing.csv: [Errno 2]"),
        ("empty_dir", "--calibrate {tmp}/empty_dir: no metrics.jsonl: not a chain's run dir"),
    ],
)
def test_a_path_with_nothing_to_calibrate_to_is_one_line_and_exit_2(tmp_path, path, message):
    (tmp_path / "empty_dir").mkdir()
    done = run_tool("orchestrator", "plan", *K70, "--calibrate", str(tmp_path / path))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert message.format(tmp=tmp_path) in done.stderr


def test_a_chains_jobs_record_what_ran_and_are_priced_as_it_ran(tmp_path, tiny_corpus):
    """The trainer writes what each job ran; read back, the config composes again and is priced
    on the layout that ran. A CPU run is left out of a calibration, with why (the step-time
    model prices GPUs); with the GPU it names, the same job is a row."""
    run_dir = tmp_path / "run"
    train(run_dir, tiny_corpus, "train.max_steps=4", "train.log_every=1", "parallel.dp_shard=2",
          nproc=2)  # fmt: skip
    assert [p.name for p in (run_dir / JOB_STARTS_DIR).iterdir()] == ["0-local.json"]
    [job] = job_segments(run_dir)
    run = job.run
    assert (run["world"], run["tasks_per_node"], run["gpu"]) == (2, 2, None)
    logged = [r["tokens_per_s"] for r in map(json.loads, (run_dir / METRICS_FILE).open())
              if "tokens_per_s" in r]  # fmt: skip
    assert len(logged) == 4 and job.speeds == logged[1:]
    done = run_tool("orchestrator", "plan", "--model", "tiny", "--gpus", "2", "--calibrate",
                    str(run_dir))  # fmt: skip
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "no measured GPU step to calibrate to" in done.stderr
    assert "left out: it ran on CPUs" in done.stderr
    run["gpu"] = "h100"  # what a GPU job records: the rest is this job's own record
    row = row_of(job, str(run_dir))
    assert row.layout.dp_shard == 2 and row.request.cluster.gpus == 2
    assert row.request.global_batch == 2 * row.layout.microbatches
    assert row.row.tokens_per_s_per_gpu == pytest.approx(statistics.median(logged[1:]) / 2)
