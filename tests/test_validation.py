"""The validation split's batches: fixed by the manifest, shared out between data-parallel ranks."""

from __future__ import annotations

from lhotse import CutSet, MonoCut

from train.eval.validation import rank_share, validation_batches


def cuts(durations: list[float]) -> CutSet:
    return CutSet.from_cuts(
        MonoCut(id=f"c{i}", start=0.0, duration=d, channel=0) for i, d in enumerate(durations)
    )


def test_batches_are_sorted_by_duration_and_packed_up_to_the_limit():
    batches = validation_batches(cuts([3.0, 1.0, 2.0, 2.0, 5.0]), max_duration=4.0)
    assert [[cut.id for cut in batch] for batch in batches] == [
        ["c1", "c2"],
        ["c3"],
        ["c0"],
        ["c4"],
    ]


def test_a_cut_longer_than_the_limit_is_a_batch_of_its_own():
    batches = validation_batches(cuts([9.0, 1.0]), max_duration=4.0)
    assert [len(batch) for batch in batches] == [1, 1]


def test_the_order_does_not_depend_on_the_manifest_order():
    forward = validation_batches(cuts([1.0, 2.0, 2.0]), max_duration=3.0)
    backward = validation_batches(CutSet.from_cuts(reversed(list(cuts([1.0, 2.0, 2.0])))), 3.0)
    assert [[c.id for c in b] for b in forward] == [["c0", "c1"], ["c2"]]
    assert [[c.id for c in b] for b in backward] == [["c0", "c1"], ["c2"]]


def test_ranks_share_every_batch_once_and_run_as_many_forwards():
    shares = [rank_share(5, rank, 2) for rank in range(2)]
    assert shares == [([0, 2, 4], 3), ([1, 3], 3)]
    assert rank_share(1, 1, 2) == ([], 1)
