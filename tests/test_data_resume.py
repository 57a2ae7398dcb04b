"""Resuming the data stream from the samplers' state: exact, per stream, and no batch re-read."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.harness.training import final_weights, metrics, train
from tests.harness.wandb_runs import WANDB_OFFLINE, base_env, of_type, wandb_records
from train.data.batch_hash import batch_hash
from train.data.layout import num_streams
from train.data.loader import (
    DataPosition,
    SpeechDataset,
    batches_from,
    build_dataloader,
)
from train.data.text import ByteTokenizer

Loader = Callable[[int, DataPosition | None], object]


def loader_for(corpus: Path, shar: bool, num_workers: int, **overrides) -> Loader:
    source = corpus / "shar" / "train" if shar else corpus / "cuts_train.jsonl.gz"
    args = {
        "max_duration": 3.0,
        "job_seed": 7,
        "dp_rank": 1,
        "dp_size": 2,
        "num_workers": num_workers,
        "text": ByteTokenizer(),
        "shar": shar,
        "buckets": 2,
        **overrides,
    }
    return lambda epoch, position: build_dataloader(source, **args, epoch=epoch, position=position)


def stream(loader: Loader, start: DataPosition, replay: int = 0) -> list:
    """(position, batch hash) of every batch from ``start`` to the end of epoch 1 (the last
    batch of epoch 1 excepted: its position is already in epoch 2)."""
    items = batches_from(loader, start, replay)
    return [
        (position, batch_hash(batch))
        for position, batch in itertools.takewhile(lambda item: item[0].epoch < 2, items)
    ]


def saved(position: DataPosition) -> dict:
    """The position as a checkpoint's state.json holds it."""
    return json.loads(json.dumps(position.state()))


def epoch_length(whole: list) -> int:
    """Batches in epoch 0: its last one already comes with the start of epoch 1."""
    return next(index for index, (position, _) in enumerate(whole) if position.epoch == 1) + 1


@pytest.mark.parametrize(
    ("shar", "num_workers"),
    [(False, 0), (False, 1), (True, 0), (True, 2), (True, 3)],
    ids=["manifest", "manifest-worker", "shar", "shar-2-workers", "shar-3-workers"],
)
def test_resume_continues_the_stream_exactly(tiny_corpus, shar, num_workers):
    """From any saved position (first batch, mid-epoch, last batches of an epoch, the epoch's
    end, just after the boundary) the same batches follow, with the same positions."""
    loader = loader_for(tiny_corpus, shar, num_workers)
    streams = num_streams(shar, num_workers)
    whole = stream(loader, DataPosition.start(streams))
    epoch_0 = epoch_length(whole)
    assert 3 <= epoch_0 < len(whole), "the corpus must give two epochs of several batches"
    assert whole[epoch_0 - 1][0] == DataPosition.start(streams, epoch=1)
    for taken in sorted({1, epoch_0 // 2, epoch_0 - 2, epoch_0 - 1, epoch_0, epoch_0 + 1}):
        start, replay = DataPosition.resume(saved(whole[taken - 1][0]), streams)
        assert replay == 0
        resumed = stream(loader, start)
        assert resumed == whole[taken:], f"resumed after {taken} batches"


def test_resume_loads_only_the_batches_it_yields(tiny_corpus, monkeypatch):
    """The samplers skip the consumed batches from cut metadata: no skipped batch is loaded
    (one is read ahead)."""
    loader = loader_for(tiny_corpus, False, 0)
    whole = stream(loader, DataPosition.start(1))
    epoch_0 = epoch_length(whole)
    loaded = []
    original = SpeechDataset.__getitem__
    monkeypatch.setattr(
        SpeechDataset, "__getitem__", lambda self, cuts: loaded.append(1) or original(self, cuts)
    )
    start, _ = DataPosition.resume(saved(whole[epoch_0 - 2][0]), 1)
    taken = list(itertools.islice(batches_from(loader, start), 3))
    assert [batch_hash(batch) for _, batch in taken] == [h for _, h in whole[epoch_0 - 1 :][:3]]
    assert len(loaded) == 4


@pytest.mark.parametrize(("shar", "num_workers"), [(False, 1), (True, 2)], ids=["manifest", "shar"])
def test_positions_without_stream_counts_still_resume(tiny_corpus, shar, num_workers):
    """Checkpoints from before per-stream counts hold only (epoch, batch_in_epoch), with the
    end of an epoch as its last batch: one stream resumes from its count, several Shar workers
    by reading and dropping the batches."""
    loader = loader_for(tiny_corpus, shar, num_workers)
    streams = num_streams(shar, num_workers)
    whole = stream(loader, DataPosition.start(streams))
    for taken in (3, epoch_length(whole)):
        old = {"epoch": 0, "batch_in_epoch": taken, "data_seed": 7}
        start, replay = DataPosition.resume(old, streams)
        assert replay == (taken if streams > 1 else 0)
        assert stream(loader, start, replay) == whole[taken:], f"resumed after {taken} batches"


def test_a_position_past_the_epoch_end_leaves_the_epoch_empty(tiny_corpus):
    """Counts from another layout may exceed this epoch's batches: the epoch ends there."""
    for shar, num_workers in ((False, 0), (True, 2)):
        streams = num_streams(shar, num_workers)
        position = DataPosition(0, (10_000,) * streams)
        assert list(loader_for(tiny_corpus, shar, num_workers)(0, position)) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("shar", "num_workers"), [(False, 1), (True, 2)], ids=["manifest", "shar-2-workers"]
)
def test_resumed_jobs_train_exactly_as_one(tmp_path, corpus, shar, num_workers):
    """2 ranks: one job of E+2 steps == three jobs stopped one step before the end of rank 0's
    first epoch (E steps) and one step after it, all with the same seed: losses and final
    weights bitwise equal, although only the split run validates (every 3 steps and as each job
    ends). Each rank's position is saved (on Shar they differ). A fourth job finds training
    finished (on the manifest: that job restores and returns whatever the data, so once is
    enough). The jobs' offline W&B files form one run whose history goes on where the job
    before stopped. Mid-epoch positions and a stop exactly at the epoch's end are covered in
    process above."""
    data = (f"data.shar={str(shar).lower()}", f"data.num_workers={num_workers}")
    rank_0 = loader_for(corpus, shar, num_workers, dp_rank=0, max_duration=8.0, buckets=4)
    epoch = sum(1 for _ in rank_0(0, None))  # rank 0's first epoch, in steps
    last = epoch + 2
    steps = (f"train.max_steps={last}", "checkpoint.interval=1000", "checkpoint.keep=10")
    common = ("seed=7", *steps, *data)
    whole, split = tmp_path / "whole", tmp_path / "split"
    train(whole, corpus, *common, "wandb.enabled=false", nproc=2)
    stops = [0, epoch - 1, epoch + 1]
    env = base_env(tmp_path)
    for budget in [*(b - a for a, b in itertools.pairwise(stops)), 0]:
        job = train(
            split,
            corpus,
            *common,
            WANDB_OFFLINE,
            "eval.interval=3",
            f"train.max_steps_per_run={budget}",
            nproc=2,
            env=env,
        )
    assert "resumed from" in job.stderr
    if not shar:
        finished = train(split, corpus, *common, WANDB_OFFLINE, "eval.interval=3", nproc=2, env=env)
        assert f"training already finished at step {last}" in finished.stderr

    losses = [(m["step"], m["loss"]) for m in metrics(whole) if "loss" in m]
    assert [step for step, _ in losses] == list(range(1, last + 1))
    assert [(m["step"], m["loss"]) for m in metrics(split) if "loss" in m] == losses
    a, b = final_weights(whole, last, tmp_path), final_weights(split, last, tmp_path)
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[name], b[name]) for name in a)
    # Every 3 steps and as each job ends (not the job that found training finished).
    validation = [m for m in metrics(split) if "val_loss" in m]
    ends = {epoch - 1, epoch + 1, last}
    assert [m["step"] for m in validation] == sorted(set(range(3, last + 1, 3)) | ends)
    assert all(m["val_split"] == "dev" and m["val_tokens"] > 0 for m in validation)

    # Rank 0's position: its epoch's last batch already counts as the start of the next epoch.
    for step, rank_0 in ((epoch - 1, (0, epoch - 1)), (epoch + 1, (1, 1))):
        state = json.loads((split / "checkpoints" / f"step_{step}" / "state.json").read_text())
        positions = state["trainer_state"]["data_positions"]
        assert [len(p["streams"]) for p in positions] == [num_streams(shar, num_workers)] * 2
        assert (positions[0]["epoch"], positions[0]["batch_in_epoch"]) == rank_0
    # On Shar the ranks are at different positions, so resuming rank 1 at rank 0's would fail.
    assert (positions[0] != positions[1]) == shar

    # The W&B run id travels in the checkpoint: every job's offline file is one run's.
    run_id = state["trainer_state"]["wandb_run_id"]
    run_files = sorted((split / "wandb").glob("offline-run-*/run-*.wandb"))  # by start time
    jobs = [wandb_records(path, tmp_path) for path in run_files]
    assert {run["run_id"] for records in jobs for run in of_type(records, "run")} == {run_id}
    history = [{row["step"]["num"] for row in of_type(records, "history")} for records in jobs]
    expected = [set(range(1, epoch)), {epoch, epoch + 1}, {last}]
    assert history[:3] == expected and not any(history[3:]), history
