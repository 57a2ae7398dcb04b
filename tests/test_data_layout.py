"""No silent change of the data position: a job resumed with its checkpoint's seed under another
data layout (data-parallel size, sources, weights, max_duration, buckets, Shar workers) is
refused before anything starts, or starts the next epoch, or applies the counts as they are
(``data.on_layout_change``, train/data/layout.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contract.run_dir import STATE_FILE, complete_checkpoints
from tests.harness.training import train
from train.config import TrainConfig
from train.data.layout import data_layout, layout_changes, refusal


def mixture(tmp_path: Path, corpus: Path, weights: tuple[float, float]) -> str:
    path = tmp_path / f"sources_{weights[0]}_{weights[1]}.yaml"
    cuts = corpus / "cuts_train.jsonl.gz"
    path.write_text(
        f"- {{cuts: {cuts}, name: a, weight: {weights[0]}}}\n"
        f"- {{cuts: {cuts}, name: b, weight: {weights[1]}}}\n"
    )
    return str(path)


def test_the_layout_names_what_the_position_depends_on(tmp_path) -> None:
    """Each field a position depends on is named when it changes; tensor, context and pipeline
    degrees are not among them (their peers share a data-parallel rank's stream); a mixture's
    weights are; Shar's workers are, a manifest's are not."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "cuts_train.jsonl.gz").touch()  # read by the trainer, not here: it need only exist
    cfg = TrainConfig()
    cfg.data.corpus = str(corpus)
    base = data_layout(cfg, dp_size=2)
    assert layout_changes(base, data_layout(cfg, dp_size=2)) == []
    assert layout_changes(base, data_layout(cfg, dp_size=4)) == ["data-parallel size 2 -> 4"]
    # A checkpoint saved before the sampler's buffer was recorded had lhotse's default.
    older = {k: v for k, v in base.items() if k != "buffer_size"}
    assert layout_changes(older, data_layout(cfg, dp_size=2)) == []
    cfg.data.max_duration, cfg.data.buckets, cfg.data.num_workers = 7.0, 2, 3
    cfg.data.buffer_size = 500
    assert layout_changes(base, data_layout(cfg, dp_size=2)) == [
        "data.max_duration 20.0 -> 7.0",
        "data.buckets 4 -> 2",
        "data.buffer_size 20000 -> 500",
    ]
    cfg.data.shar = True
    assert "streams per rank (data.num_workers with Shar) 1 -> 3" in layout_changes(
        base, data_layout(cfg, dp_size=2)
    )
    cfg = TrainConfig()
    cfg.data.input_cfg = mixture(tmp_path, corpus, (1, 1))
    even = data_layout(cfg, dp_size=2)
    cfg.data.input_cfg = mixture(tmp_path, corpus, (1, 3))
    assert layout_changes(even, data_layout(cfg, dp_size=2)) == ["the sources or their weights"]
    line = refusal("runs/x/checkpoints/step_4", ["data-parallel size 2 -> 4"])
    assert "data.on_layout_change=restart_epoch" in line and "continue" in line


def saved_state(run_dir: Path, step: int) -> dict:
    checkpoint = complete_checkpoints(run_dir)[step]
    return json.loads((checkpoint / STATE_FILE).read_text())["trainer_state"]


@pytest.mark.slow
def test_a_checkpoint_resumed_at_another_data_parallel_size_is_refused_restarted_or_continued(
    corpus, tmp_path
) -> None:
    """The real case: a chain saved at 2 data-parallel ranks, resumed at 4 with the same seed.
    Refused in one error line, exit 2, nothing trained or saved (every rank refuses, rank 0
    says why: at 4 ranks on 2 cores rank 0 was once stopped by the launcher before its line);
    with restart_epoch it trains on from the next epoch's first batch, and the log and
    metrics.jsonl say so. Back at 2 ranks with continue, each rank goes on counting from its
    saved position, with a warning that names the change."""
    run_dir = tmp_path / "run"
    common = ("seed=11", "checkpoint.interval=4", "train.log_every=1")
    train(run_dir, corpus, "train.max_steps=4", *common, nproc=2)
    assert saved_state(run_dir, 4)["data_layout"]["dp_size"] == 2

    refused = train(run_dir, corpus, "train.max_steps=6", *common, nproc=4, check=False)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert len(errors) == 1 and "data-parallel size 2 -> 4" in errors[0], refused.stderr[-3000:]
    assert sorted(complete_checkpoints(run_dir)) == [4]

    restarted = train(
        run_dir,
        corpus,
        "train.max_steps=6",
        *common,
        "data.on_layout_change=restart_epoch",
        nproc=4,
    )
    assert "starting data epoch 1 from its beginning" in restarted.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["data_epoch"] for row in rows if "data_layout_change" in row] == [1]
    state = saved_state(run_dir, 6)
    assert state["data_layout"]["dp_size"] == 4
    assert [(p["epoch"], p["batch_in_epoch"]) for p in state["data_positions"]] == [(1, 2)] * 4

    continued = train(
        run_dir, corpus, "train.max_steps=8", *common, "data.on_layout_change=continue", nproc=2
    )
    assert (
        "warning: the data layout changed since step_6 (data-parallel size 4 -> 2); its batch "
        "counts are applied as they are" in continued.stderr
    ), continued.stderr[-3000:]
    state = saved_state(run_dir, 8)
    assert state["data_layout"]["dp_size"] == 2
    assert [(p["epoch"], p["batch_in_epoch"]) for p in state["data_positions"]] == [(1, 4)] * 2
