"""Stragglers: each rank's time computing apart from its time waiting for the others, and the
rank that makes every other one wait.

In a synchronous step every rank's wall time is the slowest rank's: FSDP2 makes the others wait
inside each block's all-gather and reduce-scatter, so no clock around the step can tell a slow
rank from a waiting one. Those collectives are ours instead: FSDP2's own, wrapped (its custom
comm hooks, set on every sharded module) to add the time each blocks to a per-rank clock: the
host clock on the CPU (gloo blocks the calling thread), CUDA events on the collective's stream
on a GPU, read at the log step, which syncs anyway (no host sync of their own). A rank's compute
time over a log interval is its wall time less that; the slowest rank waits least and so
computes longest. The collectives FSDP2 issues outside these hooks (HSDP's all-reduce across
replicas), tensor and pipeline parallelism's and the trainer's own are not counted as waits:
their time counts as compute on every rank alike.

``StragglerJudge`` names a rank that was the slowest in each of ``intervals`` intervals (of
``every`` steps) in a row, its compute time over them ``ratio`` times the other ranks' median
(``train.straggler``). Where the job's allocation holds a free spare node (a recipe's
``spare_nodes``: the batch script's ORCH_SPARE_NODES), the trainer then saves and stops, and the
chain hook launches it again in the same job off the named rank's node (orchestrator/slow_nodes.py).
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
)

from contract.job_env import SPARE_NODES
from train.config import StragglerConfig
from train.parallel.distributed import say


class CommClock:
    """Seconds this rank has spent blocked in the timed collectives since the last ``take``."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.blocked = 0.0
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def timed(self, run: Callable[[], Any]) -> Any:
        """``run()`` (a collective's launch), its time counted: on the CPU as it blocks; on a
        GPU as its kernel runs on the current (the collective's) stream."""
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            result = run()
            end.record()
            self.events.append((start, end))
            return result
        began = time.perf_counter()
        try:
            return run()
        finally:
            self.blocked += time.perf_counter() - began

    def take(self) -> float:
        """The seconds counted since the last call (at a log step, after its sync)."""
        seconds = self.blocked
        for start, end in self.events:
            end.synchronize()
            seconds += start.elapsed_time(end) / 1000
        self.blocked, self.events = 0.0, []
        return seconds


class TimedWork(dist.Work):
    """An asynchronous collective's handle whose ``wait`` (where gloo blocks) is timed."""

    def __init__(self, inner: dist.Work, clock: CommClock) -> None:
        super().__init__()
        self.inner, self.clock = inner, clock

    def wait(self, timeout: Any = None) -> bool:
        return self.clock.timed(self.inner.wait)


class TimedComm:
    """The collective FSDP2 asks for (the default one that follows in the class's bases),
    timed through ``clock``: its launch, and on gloo the wait of its asynchronous handle."""

    def __init__(self, clock: CommClock) -> None:
        super().__init__()
        self.clock = clock

    def __call__(self, *args: Any, **kwargs: Any) -> dist.Work | None:
        work = self.clock.timed(lambda: super(TimedComm, self).__call__(*args, **kwargs))
        return TimedWork(work, self.clock) if work is not None and not self.clock.cuda else work


class TimedAllGather(TimedComm, DefaultAllGather):
    pass


class TimedReduceScatter(TimedComm, DefaultReduceScatter):
    pass


def time_collectives(parts: Sequence[torch.nn.Module], clock: CommClock) -> int:
    """Every FSDP2 module of ``parts`` gathers and reduces through ``clock``; how many."""
    modules = [m for part in parts for m in part.modules() if isinstance(m, FSDPModule)]
    for module in modules:
        module.set_custom_all_gather(TimedAllGather(clock))
        module.set_custom_reduce_scatter(TimedReduceScatter(clock))
    return len(modules)


@dataclass(frozen=True)
class Blame:
    """A rank named slow: its compute time over the others' median, for so many intervals."""

    rank: int
    ratio: float
    intervals: int


def ratios_to_others(compute: Sequence[float]) -> list[float]:
    """Each rank's compute time over the median of the other ranks'."""
    ratios = []
    for rank, seconds in enumerate(compute):
        others = [other for index, other in enumerate(compute) if index != rank]
        median = statistics.median(others)
        ratios.append(seconds / median if median > 0 else 1.0)
    return ratios


class StragglerJudge:
    """Names, once, a rank that was the slowest in each of the last ``intervals`` intervals
    (0: never) and, over them all, ``ratio`` times the other ranks' median compute time. The
    window's sums, not one interval's figures, decide: a step's batch differs from rank to rank
    (its lengths, its mix of sources), so one interval's slowest rank is often an honest one."""

    def __init__(self, ratio: float, intervals: int) -> None:
        self.ratio, self.intervals = ratio, intervals
        self.window: deque[list[float]] = deque(maxlen=max(intervals, 1))
        self.blamed: set[int] = set()

    def observe(self, compute: Sequence[float]) -> Blame | None:
        if len(compute) < 2 or not self.intervals:
            return None
        self.window.append(list(compute))
        if len(self.window) < self.intervals:
            return None
        slowest = {max(range(len(row)), key=row.__getitem__) for row in self.window}
        if len(slowest) != 1:
            return None
        rank = slowest.pop()
        ratio = ratios_to_others([sum(column) for column in zip(*self.window, strict=True)])[rank]
        if ratio < self.ratio or rank in self.blamed:
            return None
        self.blamed.add(rank)
        return Blame(rank, ratio, len(self.window))


def interval_figures(compute: Sequence[float], waited: Sequence[float]) -> dict[str, float]:
    """A log interval's per-rank figures for the metrics line: compute time's min, median and
    max over the ranks (seconds a step), the slowest rank and its ratio to the others."""
    ratios = ratios_to_others(compute) if len(compute) > 1 else [1.0]
    slowest = max(range(len(compute)), key=compute.__getitem__)
    return {
        "compute_s_min": min(compute),
        "compute_s_median": statistics.median(compute),
        "compute_s_max": max(compute),
        "wait_s_max": max(waited),
        "slowest_rank": slowest,
        "slowest_ratio": ratios[slowest],
    }


def place() -> tuple[str, int | None]:
    """Where this rank runs: the node (SLURM's name for it, which ``--exclude`` takes; else
    the host's), and its GPU where there is one."""
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    return node, torch.cuda.current_device() if torch.cuda.is_initialized() else None


class StragglerWatch:
    """Per interval of at least ``every`` steps (ended at a log step): every rank's compute and
    wait seconds a step, gathered (one small all-gather at that log step, which syncs anyway),
    the metrics line's figures and, on a rank slow for long enough, the blame: a log line and
    the line's ``straggler_*`` fields. A save or a validation starts a new interval."""

    def __init__(
        self,
        parts: Sequence[torch.nn.Module],
        settings: StragglerConfig,
        device: torch.device,
    ) -> None:
        self.device, self.every = device, settings.every
        self.clock = CommClock(device)
        self.timed = time_collectives(parts, self.clock) if dist.get_world_size() > 1 else 0
        self.judge = StragglerJudge(settings.ratio, settings.intervals)
        self.places: list[tuple[str, int | None]] | None = None
        self.since, self.since_step = time.perf_counter(), 0
        # The ranks named this job, for its end-of-job record (the chain's record of them).
        self.named: list[dict[str, Any]] = []
        # A spare node free in the allocation: the first node named is left for it.
        self.spare = int(os.environ.get(SPARE_NODES) or 0)
        self.leaving: str | None = None  # the node this launch stops to leave

    def resume(self, step: int) -> None:
        """Intervals count from now, after ``step`` (a job's start, a save, a validation)."""
        self.clock.take()
        self.since, self.since_step = time.perf_counter(), step

    def interval(self, step: int) -> dict[str, Any]:
        """At log step ``step``: once ``every`` steps have passed since the interval began, its
        figures for the metrics line (else, on one rank, or where no collective is timed,
        none). Every rank calls it: the gather is collective."""
        if not self.timed or step - self.since_step < self.every:
            return {}
        if self.places is None:
            self.places = [("", None)] * dist.get_world_size()
            dist.all_gather_object(self.places, place())
        steps = max(step - self.since_step, 1)
        waited = self.clock.take()
        wall = time.perf_counter() - self.since
        mine = torch.tensor([(wall - waited) / steps, waited / steps], dtype=torch.float64)
        mine = mine.to(self.device)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)  # (all_gather_into_tensor warns of its deprecation)
        figures = torch.stack(everyone).tolist()
        compute, waits = [row[0] for row in figures], [row[1] for row in figures]
        self.since, self.since_step = time.perf_counter(), step
        record: dict[str, Any] = interval_figures(compute, waits)
        blame = self.judge.observe(compute)
        if blame is not None:
            node, gpu = self.places[blame.rank]
            where = node if gpu is None else f"{node} GPU {gpu}"
            say(
                f"slow: node {where}, rank {blame.rank}, {blame.ratio:.1f}x the other ranks' "
                f"median compute time a step, {blame.intervals} intervals of {self.every} "
                "steps in a row (train.straggler): every rank waits for it"
            )
            record.update(
                straggler_rank=blame.rank, straggler_ratio=blame.ratio, straggler_node=where
            )
            named = {"node": node, "rank": blame.rank, "ratio": round(blame.ratio, 2), "step": step}
            self.named.append(named if gpu is None else {**named, "gpu": gpu})
            if self.spare > 0 and self.leaving is None:
                self.leaving = node
                say(f"stopping after a save to leave node {node} for the job's spare node")
        return record

    def leave_reason(self) -> str | None:
        """Why this launch stops (at the step it named a rank on a node to leave), else None."""
        if self.leaving is None:
            return None
        return f"leaving slow node {self.leaving} for a spare node of the job"
