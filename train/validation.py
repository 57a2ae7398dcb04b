"""Validation loss over a whole split, apart from training's data position and random state.

The split's cuts are sorted by (duration, id) and packed greedily into batches of at most
``max_duration`` seconds, so the batches depend on the manifest and the batch size alone: the
same at any layout, in any job. Data-parallel rank ``r`` of ``n`` takes batches ``r, r + n, ...``
(TP, CP and PP peers share its coordinate and read the same ones); every rank runs the same
number of forwards, a rank with fewer batches repeating its first one and discarding the
result, because sharded layers communicate in every forward. Nothing here draws a random
number or touches the training loader, so a run with validation trains exactly as one without.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

from lhotse import CutSet
from lhotse.cut import Cut

from train.data import Batch, SpeechDataset, TextCodec
from train.features import Featurizer


def validation_batches(cuts: Iterable[Cut], max_duration: float) -> list[CutSet]:
    """The split's batches: cuts sorted by (duration, id), each batch up to ``max_duration``
    seconds (a longer cut makes a batch of its own)."""
    ordered = sorted(cuts, key=lambda cut: (cut.duration, cut.id))
    batches: list[list] = []
    seconds = 0.0
    for cut in ordered:
        if batches and seconds + cut.duration <= max_duration:
            batches[-1].append(cut)
            seconds += cut.duration
        else:
            batches.append([cut])
            seconds = cut.duration
    return [CutSet.from_cuts(batch) for batch in batches]


def rank_share(num_batches: int, dp_rank: int, dp_size: int) -> tuple[list[int], int]:
    """This rank's batch indices and how many forwards every rank runs (the most any has)."""
    return list(range(dp_rank, num_batches, dp_size)), math.ceil(num_batches / dp_size)


class ValidationSet:
    """One data-parallel rank's share of one validation set, as (batch, counts) pairs per pass.

    Batches whose features are computed from audio (a pretrained encoder's extractor, a source
    without stored features) are kept after the first pass: the set is the same at every
    validation, so the audio is decoded and featurized once (bench/bench_features.py: 2-3 ms per
    2-s utterance on one core here, against 0.1 ms to read features back).
    """

    def __init__(
        self,
        name: str,
        cuts: Iterable[Cut],
        max_duration: float,
        dp_rank: int,
        dp_size: int,
        text: TextCodec,
        featurize: Featurizer,
    ) -> None:
        self.name = name
        batches = validation_batches(cuts, max_duration)
        if not batches:
            raise ValueError(f"validation set {name} holds no cuts")
        indices, self.forwards = rank_share(len(batches), dp_rank, dp_size)
        self.batches = [batches[index] for index in indices] or [batches[0]]
        self.has_own = bool(indices)
        self.dataset = SpeechDataset(text, featurize)
        self.keep = not featurize.extractor.uses_stored or not all(
            cut.has_features for batch in self.batches for cut in batch
        )
        self.kept: dict[int, Batch] = {}

    def __iter__(self) -> Iterator[tuple[Batch, bool]]:
        """``forwards`` batches: (batch, whether it counts); the fillers repeat the first."""
        for index in range(self.forwards):
            counts = self.has_own and index < len(self.batches)
            yield self.batch(index if counts else 0), counts

    def batch(self, index: int) -> Batch:
        if index in self.kept:
            return self.kept[index]
        batch = self.dataset[self.batches[index]]
        if self.keep:
            self.kept[index] = batch
        return batch
