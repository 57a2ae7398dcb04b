"""Validation losses and evaluations in status and plot, from files written here in the documented
format (metrics.jsonl validation rows, eval/step_<N>/summary.json): the latest of each, members
of a sweep best first, missing values, and validation rows that older readers must survive."""

from __future__ import annotations

import math
import subprocess

from orchestrator.manifest import register_sweep
from orchestrator.plot import draw, plot_data
from orchestrator.results import (
    Evaluation,
    RunResults,
    Validation,
    disk_problem,
    latest_evaluation,
)
from tests.harness.disk import fill_disk
from tests.harness.process import run_tool
from tests.harness.results import make_chain, status_json, train_row, val_row, write_eval


def trained(chain_id: str, val_losses: tuple[float, ...] = ()) -> list[dict]:
    """Two jobs of 2 steps each, a validation row after each job's last step."""
    rows = []
    for job_index in (0, 1):
        for step in (2 * job_index + 1, 2 * job_index + 2):
            rows.append(train_row(chain_id, step, job_index, 5.0 - step))
        if job_index < len(val_losses):
            rows.append(val_row(chain_id, 2 * job_index + 2, job_index, val_losses[job_index]))
    return rows


def test_latest_evaluation_is_the_highest_step_that_parses(tmp_path):
    assert latest_evaluation(tmp_path) is None
    write_eval(tmp_path, 20, 0.30)
    write_eval(tmp_path, 100, 0.20)
    write_eval(tmp_path, 300, 0.10, text='{"step": 300, "wer": 0.1')  # still being written
    write_eval(tmp_path, 400, 0.10, text='{"step": 400, "split": "dev"}')  # no wer
    (tmp_path / "eval" / "step_500").mkdir()  # no summary yet
    (tmp_path / "eval" / "step_x").mkdir()
    assert latest_evaluation(tmp_path) == Evaluation(100, "dev", 0.20, 0.10, 64)


def test_runs_rank_by_wer_then_val_loss_then_nothing():
    def run(wer: float | None = None, val_loss: float | None = None) -> RunResults:
        return RunResults(
            Validation(10, val_loss, "dev", 0) if val_loss is not None else None,
            Evaluation(10, "dev", wer, None, None) if wer is not None else None,
        )

    runs = {
        "nothing": run(),
        "val 2.0": run(val_loss=2.0),
        "wer 0.3": run(wer=0.3, val_loss=1.0),
        "val nan": run(val_loss=math.nan),
        "val 1.5": run(val_loss=1.5),
        "wer 0.1": run(wer=0.1, val_loss=3.0),
    }
    ranked = sorted(runs, key=lambda name: runs[name].rank_key())
    assert ranked == ["wer 0.1", "wer 0.3", "val 1.5", "val 2.0", "val nan", "nothing"]


def test_status_of_a_run_shows_its_latest_val_loss_and_wer(tmp_path):
    run_dir = make_chain(tmp_path, "results-chain", trained("results-chain", (3.5, 2.75)))
    write_eval(run_dir, 2, 0.5)
    write_eval(run_dir, 4, 0.153)

    status = status_json(str(run_dir))
    assert status["validation"] == {"step": 4, "val_loss": 2.75, "split": "dev", "job_index": 1}
    assert status["evaluation"] == {
        "step": 4,
        "split": "dev",
        "wer": 0.153,
        "cer": 0.0765,
        "num_utterances": 64,
    }
    # Validation rows carry no loss: each job's step and loss still come from training rows.
    assert [(job["last_step"], job["last_loss"]) for job in status["jobs"]] == [(2, 3.0), (4, 1.0)]

    text = run_tool("orchestrator", "status", str(run_dir)).stdout.splitlines()
    assert text[1] == (
        "latest: val_loss 2.7500 at step 4 (dev); "
        "WER 15.30% at step 4 (dev, CER 7.65%, 64 utterances)"
    )
    assert text[2].split()[:6] == ["index", "job_id", "seed", "state", "step", "loss"]
    assert text[4].split()[4:6] == ["4", "1.0000"]


def test_status_of_a_run_without_results(tmp_path):
    run_dir = make_chain(tmp_path, "no-results-chain", trained("no-results-chain"))
    status = status_json("no-results-chain")
    assert status["validation"] is None and status["evaluation"] is None
    text = run_tool("orchestrator", "status", str(run_dir)).stdout.splitlines()
    assert text[1] == "latest: val_loss -; WER -"


def test_status_of_a_sweep_ranks_its_members_best_first(tmp_path):
    sweep = "results-sweep"
    members = {  # chain id -> (val losses, WER at step 4 or None)
        f"{sweep}-0": ((3.0, 2.0), None),
        f"{sweep}-1": ((3.0, 2.5), 0.25),
        f"{sweep}-2": ((), None),
        f"{sweep}-3": ((3.0, 2.9), 0.125),
        f"{sweep}-4": ((1.5,), None),
    }
    for chain_id, (val_losses, wer) in members.items():
        run_dir = make_chain(tmp_path, chain_id, trained(chain_id, val_losses))
        if wer is not None:
            write_eval(run_dir, 4, wer)
    register_sweep(
        sweep,
        [
            {"chain_id": chain_id, "run_dir": str(tmp_path / chain_id), "overrides": [f"lr={i}"]}
            for i, chain_id in enumerate(members)
        ],
    )
    best = [f"{sweep}-{i}" for i in (3, 1, 4, 0, 2)]
    status = status_json(sweep)
    assert status["best_first"] == best
    assert [chain["chain_id"] for chain in status["chains"]] == list(members)
    assert [c["evaluation"]["wer"] if c["evaluation"] else None for c in status["chains"]] == [
        None,
        0.25,
        None,
        0.125,
        None,
    ]

    text = run_tool("orchestrator", "status", sweep).stdout.splitlines()
    table = text[text.index(f"sweep {sweep}: 5 member(s), best first") + 1 :]
    assert table[0].split() == [
        "rank",
        "chain",
        "wer",
        "eval_step",
        "val_loss",
        "val_step",
        "overrides",
    ]
    assert [line.split() for line in table[1:]] == [
        ["1", f"{sweep}-3", "12.50%", "4", "2.9000", "4", "lr=3"],
        ["2", f"{sweep}-1", "25.00%", "4", "2.5000", "4", "lr=1"],
        ["3", f"{sweep}-4", "-", "-", "1.5000", "2", "lr=4"],
        ["4", f"{sweep}-0", "-", "-", "2.0000", "4", "lr=0"],
        ["5", f"{sweep}-2", "-", "-", "-", "-", "lr=2"],
    ]


def test_plot_draws_val_loss_and_names_the_latest_wer(tmp_path):
    run_dir = make_chain(tmp_path, "plot-val-chain", trained("plot-val-chain", (3.5, 2.75)))
    write_eval(run_dir, 2, 0.5)
    write_eval(run_dir, 4, 0.153)
    (series,) = plot_data(str(run_dir)).series
    assert [(e.step, e.wer) for e in series.evaluated] == [(2, 0.5), (4, 0.153)]
    assert series.steps == [1, 2, 3, 4]
    assert series.losses == [4.0, 3.0, 2.0, 1.0]
    assert [(job.job_index, job.first_step, job.last_step) for job in series.jobs] == [
        (0, 1, 2),
        (1, 3, 4),
    ]
    assert series.boundaries == [2.5]
    assert (series.val_steps, series.val_losses) == ([2, 4], [3.5, 2.75])
    assert series.legend_label == "plot-val-chain: WER 15.30% (step 4)"
    out = draw(plot_data(str(run_dir)), tmp_path / "plot.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_of_a_chain_with_only_validation_rows(tmp_path):
    run_dir = make_chain(tmp_path, "plot-val-only", [val_row("plot-val-only", 0, 0, 4.5)])
    done = run_tool("orchestrator", "plot", str(run_dir))
    assert done.returncode == 0, done.stderr
    (series,) = plot_data(str(run_dir)).series
    assert series.steps == [] and series.jobs == [] and series.val_losses == [4.5]
    assert series.legend_label == "plot-val-only"


def test_status_names_a_full_or_read_only_run_dir_disk(small_disk):
    """The trainer's own error may be lost (its log is on the full disk): status says it."""
    step = small_disk / "run" / "checkpoints" / "step_2"
    step.mkdir(parents=True)
    (step / "model.distcp").write_bytes(b"\0" * 600_000)
    (step / "COMPLETE").write_text("")
    assert disk_problem(small_disk / "run") is None
    fill_disk(small_disk, leave=100_000)
    problem = disk_problem(small_disk / "run")
    assert problem is not None and "disk is full" in problem and "step_2" in problem
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    assert "read-only" in (disk_problem(small_disk / "run") or "")
