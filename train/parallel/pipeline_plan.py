"""Pipeline schedules and stage splits, as plain arithmetic checked before any process group.

The LLM's blocks are cut into ``pp * stages_per_rank`` contiguous stages. Stage 0 also holds the
audio encoder, the projector and the embeddings; the last stage holds the final norm, the head
and the loss. Stage ``s`` runs on pipeline rank ``s % pp`` (the looped placement every schedule
here shares), so with two stages per rank, rank 0 holds stages 0 and ``pp``.

By default the blocks are split so that the largest stage, counted in parameters (the encoder's
and the head's included), is as small as it can be; ``pp_split`` names the block count of each
stage instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from train.models.inventory import inventory, stage_param_counts
from train.models.shape import SALMConfig

# zero_bubble is a known name so that asking for it gets the reason it is refused.
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
# Schedules that run several stages per rank (torch's looped placement).
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zero_bubble")


@dataclass(frozen=True)
class PipelinePlan:
    """One job's pipeline: its schedule, microbatches, and the blocks of every stage."""

    pp: int
    schedule: str
    microbatches: int
    stages_per_rank: int
    split: tuple[int, ...]  # LLM blocks per stage, in stage order

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def stage_blocks(self, stage: int) -> range:
        """Indices of the LLM blocks stage ``stage`` runs."""
        start = sum(self.split[:stage])
        return range(start, start + self.split[stage])

    def local_stages(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank ``pp_rank`` runs, in order."""
        return list(range(pp_rank, self.num_stages, self.pp))

    def describe(self) -> str:
        """The stage split, one clause per stage, for the startup line."""
        parts = []
        for stage in range(self.num_stages):
            blocks = self.stage_blocks(stage)
            pieces = ["encoder+projector+embeddings"] if stage == 0 else []
            pieces.append(f"blocks {blocks.start}-{blocks.stop - 1}")
            if stage == self.num_stages - 1:
                pieces.append("norm+head+loss")
            parts.append(f"stage {stage} on pp rank {stage % self.pp}: {', '.join(pieces)}")
        return (
            f"pipeline {self.schedule}, {self.microbatches} microbatches, "
            f"{self.stages_per_rank} stage(s) per rank; " + "; ".join(parts)
        )


def balanced_split(
    block_params: Sequence[int], num_stages: int, first_extra: int, last_extra: int
) -> tuple[int, ...]:
    """Contiguous, non-empty groups of blocks, one per stage, whose largest parameter count
    (the first stage's plus ``first_extra``, the last's plus ``last_extra``) is smallest."""
    n = len(block_params)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} blocks into {num_stages} non-empty stages")
    prefix = [0]
    for count in block_params:
        prefix.append(prefix[-1] + count)

    # best[s][i]: the smallest possible largest stage when stages 0..s-1 hold blocks 0..i-1.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for stage in range(1, num_stages + 1):
        extra = (first_extra if stage == 1 else 0) + (last_extra if stage == num_stages else 0)
        previous, current, cuts = best[stage - 1], best[stage], cut[stage]
        for stop in range(stage, n - (num_stages - stage) + 1):
            end = prefix[stop] + extra
            for start in range(stage - 1, stop):
                cost = max(previous[start], end - prefix[start])
                if cost < current[stop]:
                    current[stop], cuts[stop] = cost, start
    sizes, stop = [], n
    for stage in range(num_stages, 0, -1):
        start = cut[stage][stop]
        sizes.append(stop - start)
        stop = start
    return tuple(reversed(sizes))


def plan_pipeline(
    pp: int,
    schedule: str,
    microbatches: int,
    stages_per_rank: int,
    split: Sequence[int],
    block_params: Sequence[int],
    first_extra: int,
    last_extra: int,
) -> PipelinePlan:
    """The plan for these settings, or a one-line ValueError naming the setting to change.

    ``microbatches`` 0 means ``2 * pp``; ``stages_per_rank`` 0 means 2 for the interleaved and
    zero-bubble schedules, 1 otherwise; an empty ``split`` means balanced by parameters.
    """
    n_blocks = len(block_params)
    if schedule not in PP_SCHEDULES:
        raise ValueError(
            f"parallel.pp_schedule={schedule!r} is unknown: choose one of {', '.join(PP_SCHEDULES)}"
        )
    if schedule == "zero_bubble":
        raise ValueError(
            "parallel.pp_schedule=zero_bubble is not supported by this torch: its separate "
            "weight-gradient pass does not reach FSDP2-sharded parameters, and every pipeline "
            "stage here is FSDP2; use interleaved_1f1b"
        )
    multi = schedule in MULTI_STAGE_SCHEDULES
    stages_per_rank = stages_per_rank or (2 if multi else 1)
    microbatches = microbatches or 2 * pp
    if stages_per_rank < 1 or microbatches < 1:
        raise ValueError("parallel.pp_microbatches and parallel.pp_stages_per_rank must be >= 0")
    if not multi and stages_per_rank != 1:
        raise ValueError(
            f"parallel.pp_schedule={schedule} runs one stage per rank, but "
            f"parallel.pp_stages_per_rank={stages_per_rank}: use interleaved_1f1b or zero_bubble "
            "for virtual stages"
        )
    num_stages = pp * stages_per_rank
    if num_stages > n_blocks:
        raise ValueError(
            f"pp={pp} x {stages_per_rank} stage(s) per rank = {num_stages} stages, but the model "
            f"has {n_blocks} LLM blocks: every stage needs at least one; lower pp or "
            "parallel.pp_stages_per_rank"
        )
    if schedule == "1f1b" and microbatches < pp:
        raise ValueError(
            f"parallel.pp_microbatches={microbatches} is fewer than pp={pp}: 1f1b needs at least "
            "one microbatch per stage; raise parallel.pp_microbatches"
        )
    if multi:
        rounds = max(1, microbatches // pp)
        if microbatches < pp or microbatches % rounds:
            raise ValueError(
                f"parallel.pp_microbatches={microbatches} does not suit {schedule} at pp={pp}: "
                "it needs at least pp microbatches, in whole rounds of pp; use a multiple of pp"
            )
    if split:
        sizes = tuple(int(size) for size in split)
        if len(sizes) != num_stages or min(sizes) < 1 or sum(sizes) != n_blocks:
            raise ValueError(
                f"parallel.pp_split={list(sizes)} must give {num_stages} positive block counts "
                f"(one per stage) that add up to the model's {n_blocks} LLM blocks"
            )
    elif multi and n_blocks % num_stages:
        raise ValueError(
            f"{schedule} with {num_stages} stages needs the {n_blocks} LLM blocks to divide "
            "evenly between them: change parallel.pp_stages_per_rank or give parallel.pp_split"
        )
    elif multi:
        sizes = (n_blocks // num_stages,) * num_stages
    else:
        sizes = balanced_split(block_params, num_stages, first_extra, last_extra)
    return PipelinePlan(pp, schedule, microbatches, stages_per_rank, sizes)


def pipeline_plan(
    cfg: SALMConfig,
    pp: int,
    schedule: str,
    microbatches: int,
    stages_per_rank: int,
    split: Sequence[int],
) -> PipelinePlan:
    """The plan for ``cfg``'s model, its stages balanced by parameter count (the inventory's,
    which tests hold to the model's own); raises a one-line ValueError for settings that cannot
    run. The trainer, the evaluation and the planner all plan with this."""
    blocks, first, last = stage_param_counts(inventory(cfg), cfg.n_layers)
    return plan_pipeline(pp, schedule, microbatches, stages_per_rank, split, blocks, first, last)
