"""Python's cycle collector on a training rank (train/loop/garbage.py): during a real training run
(the trainer built and run in this process, one rank) collections happen at the loop's
interval and where every rank pauses together, never on their own; the run leaves the
process's collector as it found it; dataloader workers collect as usual."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.training import trainer_in_process
from train.config import TrainConfig, TrainLoopConfig, validate
from train.data.loader import init_worker
from train.loop.garbage import YOUNG, Collector

FULL = 2  # the oldest generation: a full collection


@pytest.fixture
def collector_restored() -> Iterator[None]:
    """This process's collector as it was, whatever the test leaves."""
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    gc.enable() if enabled else gc.disable()


def collections_during(action) -> list[int]:
    """The generation of each collection that ran while ``action()`` ran."""
    seen: list[int] = []

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(record)
    try:
        action()
    finally:
        gc.callbacks.remove(record)
    return seen


def test_a_run_collects_at_its_interval_and_where_ranks_pause_only(
    corpus: Path, tmp_path: Path, one_rank_group: None, collector_restored: None
) -> None:
    trainer = trainer_in_process(
        tmp_path / "run",
        corpus,
        "train.max_steps=6",
        "train.gc_interval=3",
        "checkpoint.interval=100",
        "eval.interval=100",
        "wandb.enabled=false",
    )
    steps: list[tuple[int, int]] = []  # (step, generation) of each collection in the run

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            steps.append((trainer.step, info["generation"]))

    gc.enable()
    gc.callbacks.append(record)
    try:
        assert trainer.run() == 0
    finally:
        gc.callbacks.remove(record)
    # Steps 3 and 6 the loop's young collections; after step 6 the job's save and its
    # validation pass, a full collection each. Without the loop's control, Python's automatic
    # collections (generation 0, every 700 allocations) would be hundreds.
    assert steps == [(3, YOUNG), (6, YOUNG), (6, FULL), (6, FULL)], steps
    assert gc.isenabled() and gc.get_freeze_count() == 0  # given back as found


def test_the_collector_freezes_what_the_build_made_and_gives_it_back(
    collector_restored: None,
) -> None:
    gc.disable()  # as python -m train pauses it before the imports and the build
    made = [[] for _ in range(1000)]
    with Collector(interval=50) as collector:
        assert not gc.isenabled() and gc.get_freeze_count() >= len(made)
        assert collections_during(lambda: [collector.after_step(s) for s in range(1, 50)]) == []
        assert collections_during(lambda: collector.after_step(100)) == [YOUNG]
        assert collections_during(collector.at_pause) == [FULL]
    assert not gc.isenabled() and gc.get_freeze_count() == 0


def test_gc_interval_0_leaves_pythons_automatic_collection_on(collector_restored: None) -> None:
    gc.disable()
    with Collector(interval=0) as collector:
        assert gc.isenabled()
        assert collections_during(lambda: collector.after_step(50)) == []
        assert collections_during(collector.at_pause) == []
    assert not gc.isenabled()


def test_a_dataloader_worker_collects_as_usual(collector_restored: None) -> None:
    """A worker forked from a paused rank would otherwise never collect its cycles."""
    gc.disable()
    init_worker(0, job_seed=1, dp_rank=0, epoch=0)
    assert gc.isenabled()


def test_a_negative_gc_interval_is_refused() -> None:
    with pytest.raises(ValueError, match=r"train\.gc_interval=-1: must be 0 \(Python's automatic"):
        validate(TrainConfig(train=TrainLoopConfig(gc_interval=-1)))
