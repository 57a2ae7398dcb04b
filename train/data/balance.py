"""A step's examples dealt to the data-parallel ranks by their training FLOPs, not their seconds.

lhotse's sampler fills each rank's batch up to ``data.max_duration`` seconds of audio, but a
rank's work grows faster than its seconds (the encoder's attention with a segment's length, the
decoder's with its text), and every rank of a synchronous step waits for the busiest: on
conversations the busiest rank does 15-21% more than the mean (docs/performance.md).

Every data-parallel rank's sampler draws the batches of all ranks and keeps its own
(lhotse's ``CutSampler.__next__`` keeps ``batches[rank]`` of ``world_size`` draws), so each rank
sees the same step. ``BalancedSampler`` draws the batches of ``window`` steps, pools their
examples and deals them again (``deal``): the costliest first, each to the window's bin (steps x
ranks) that has the least work so far and still room for its seconds under ``max_duration``;
the bins of similar work then make up each step. Every rank computes the same deal from the
same draws, so ranks still read disjoint examples and each example once per epoch; a resumed
sampler, which re-draws its batches from the epoch's start (``train.data.loader.fast_forward``),
deals them alike, so resuming stays bitwise. Where no deal fits the seconds, the window's
batches stay as drawn.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lhotse import CutSet
from lhotse.cut import Cut
from lhotse.dataset import DynamicBucketingSampler

# The costs of a list of cuts, one number each (``train.data.work.flops_cost``: by a model).
CostOf = Callable[[Sequence[Cut]], list[float]]
SECONDS_SLACK = 1e-6  # float sums of durations that equal max_duration still fit


@dataclass(frozen=True)
class Balance:
    """How a sampler deals a step's examples: by ``cost``, pooled over ``window`` steps."""

    cost: CostOf
    window: int = 1


def deal(
    costs: Sequence[float], seconds: Sequence[float], bins: int, capacity: float
) -> list[list[int]] | None:
    """The items' indices in each of ``bins`` bins (each list in index order): the costliest
    item first, each to the bin with the least cost so far among those its ``seconds`` fit in
    under ``capacity`` (ties: the lower bin). None when an item fits in no bin."""
    loads = [(0.0, b) for b in range(bins)]  # a heap of (cost so far, bin)
    held = [0.0] * bins
    dealt: list[list[int]] = [[] for _ in range(bins)]
    for item in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        passed = []
        while loads:
            load, b = heapq.heappop(loads)
            if held[b] + seconds[item] <= capacity + SECONDS_SLACK:
                break
            passed.append((load, b))
        else:
            return None
        dealt[b].append(item)
        held[b] += seconds[item]
        heapq.heappush(loads, (load + costs[item], b))
        for entry in passed:
            heapq.heappush(loads, entry)
    return [sorted(items) for items in dealt]


def steps_of(bins: list[list[int]], costs: Sequence[float], ranks: int) -> list[list[int]]:
    """The dealt bins grouped ``ranks`` to a step, bins of similar cost together (lightest
    step first): the order in which the ranks take them."""
    load = [sum(costs[i] for i in items) for items in bins]
    order = sorted(range(len(bins)), key=lambda b: (load[b], b))
    return [order[s : s + ranks] for s in range(0, len(order), ranks)]


class BalancedSampler(DynamicBucketingSampler):
    """lhotse's bucketing sampler whose batches of ``window`` steps are dealt to the ranks by
    ``cost`` (the module docstring). At one rank it is lhotse's sampler unchanged."""

    def __init__(self, cuts: CutSet, *, cost: CostOf, window: int, **kwargs) -> None:
        super().__init__(cuts, **kwargs)
        self.cost, self.window = cost, window
        self.dealt: deque[CutSet] = deque()  # the window's batches, rank by rank, step by step

    def __iter__(self) -> BalancedSampler:
        if not self._just_restored_state:
            self.dealt.clear()
        return super().__iter__()

    def _next_batch(self) -> CutSet:
        """The next rank's batch of the dealt window; lhotse's ``__next__`` draws
        ``world_size`` of them a step and keeps its rank's."""
        if self.world_size == 1:
            return super()._next_batch()
        if not self.dealt:
            self.dealt.extend(self.deal_window())
        if not self.dealt:
            raise StopIteration
        return self.dealt.popleft()

    def deal_window(self) -> list[CutSet]:
        """The next ``window`` steps' batches, dealt: whole steps only (a step some rank would
        have no batch for ends the epoch, as lhotse's ``drop_last``)."""
        drawn: list[CutSet] = []
        for _ in range(self.window * self.world_size):
            try:
                drawn.append(super()._next_batch())
            except StopIteration:
                break
        drawn = drawn[: len(drawn) - len(drawn) % self.world_size]
        if not drawn:
            return []
        pool = [cut for batch in drawn for cut in batch]
        costs = self.cost(pool)
        bins = deal(costs, [cut.duration for cut in pool], len(drawn), self.max_duration)
        if bins is None:
            return drawn
        ordered = [b for step in steps_of(bins, costs, self.world_size) for b in step]
        return [CutSet.from_cuts(pool[i] for i in bins[b]) for b in ordered]
