"""Bytes of parameters, gradients and optimizer states one rank holds under a layout.

Exact, not estimated: it follows each tensor through TP, EP, PP and FSDP2 as the trainer places
it (``train.models.inventory``) and counts what the trainer allocates for it:

- parameters: fp32 (FSDP2's mixed precision keeps fp32 shards and casts to bf16 per use); an
  FSDP2 shard is allocated padded to ``ceil(n / shards)`` rows;
- gradients: fp32, the shapes of the parameters (FSDP2 reduce-scatters into padded shards);
- AdamW (fused): two fp32 moments per parameter in its unpadded local shape, and one fp32
  step count per tensor;
- frozen tensors (``model.freeze``): parameters only.

The figure is that of a pipeline stage's busiest rank: TP rank 0 (the largest ``torch.chunk``
piece) and FSDP shard 0, which is never short of its ``ceil(n / shards)`` rows. The other
ranks of the stage hold as much (padded parameters and gradients) or less (shorter TP pieces,
unpadded moments). The trainer's ``memory`` record of metrics.jsonl measures the same three
figures per rank; tests/test_planner_memory.py holds them equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from train.models.inventory import COLUMN, ROW, ParamTensor
from train.parallel.dims import ParallelDims
from train.parallel.pipeline_plan import PipelinePlan

FP32 = 4
ADAM_MOMENTS = 2


@dataclass(frozen=True)
class StateBytes:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def chunk_rows(n: int, parts: int, index: int) -> int:
    """Rows of piece ``index`` when ``torch.chunk`` cuts ``n`` rows into ``parts``."""
    size = math.ceil(n / parts)
    return max(0, min(size, n - index * size))


def uses_fsdp(dims: ParallelDims, strategy: str, bf16: bool) -> bool:
    """Whether FSDP2 wraps the model (``parallelize.needs_fsdp``): it shards over more than one
    rank (or replicas, HSDP), casts to bf16, or follows EP or TP."""
    if strategy != "fsdp2":
        return False
    sharded = dims.dp_replicate * dims.dp_shard * dims.cp > 1
    return sharded or dims.ep > 1 or dims.tp > 1 or bf16


# Distinct tensors with how many of each there are and whether they train (model.freeze).
Counted = tuple[tuple[ParamTensor, int, bool], ...]


@dataclass(frozen=True)
class BlockRun:
    """Consecutive LLM blocks ``start``..``stop - 1`` that hold the same tensors, each block
    ``tensors`` (a freeze rule naming some blocks cuts the blocks into runs)."""

    start: int
    stop: int
    tensors: Counted

    @property
    def block_numel(self) -> int:
        return sum(t.numel * n for t, n, _ in self.tensors)


@dataclass(frozen=True)
class GroupedInventory:
    """The inventory as distinct tensors with their counts: the encoder and embeddings (stage
    0), the LLM's blocks as runs of like blocks, the head (the last stage)."""

    first: Counted
    runs: tuple[BlockRun, ...]
    last: Counted
    n_blocks: int

    @property
    def block_numel(self) -> int:
        """The largest block's elements (what FSDP2 gathers at once)."""
        return max((run.block_numel for run in self.runs), default=0)

    @property
    def numel(self) -> int:
        return self._numel(trainable_only=False)

    @property
    def trainable_numel(self) -> int:
        return self._numel(trainable_only=True)

    def _numel(self, trainable_only: bool) -> int:
        def elements(tensors: Counted, blocks: int = 1) -> int:
            return blocks * sum(
                t.numel * n for t, n, trains in tensors if trains or not trainable_only
            )

        runs = sum(elements(run.tensors, run.stop - run.start) for run in self.runs)
        return elements(self.first) + elements(self.last) + runs


def _counted(tensors: list[ParamTensor], frozen: frozenset[str]) -> Counted:
    counts: dict[tuple, list] = {}
    for t in tensors:
        trains = t.name not in frozen
        counts.setdefault((t.shape, t.tp, t.expert, trains), [t, 0, trains])[1] += 1
    return tuple((t, n, trains) for t, n, trains in counts.values())


def _alike(a: Counted, b: Counted) -> bool:
    """Whether two blocks hold the same tensors (their names aside)."""

    def placed(counted: Counted) -> list[tuple]:
        return [(t.shape, t.tp, t.expert, n, trains) for t, n, trains in counted]

    return placed(a) == placed(b)


def group(tensors: list[ParamTensor], frozen: frozenset[str] = frozenset()) -> GroupedInventory:
    """``tensors`` grouped; ``frozen`` names those that get no gradient and no optimizer state."""
    blocks: dict[int, list[ParamTensor]] = {}
    for t in tensors:
        if t.section == "block":
            blocks.setdefault(t.block, []).append(t)
    runs: list[BlockRun] = []
    for index in sorted(blocks):
        counted = _counted(blocks[index], frozen)
        if runs and _alike(runs[-1].tensors, counted) and runs[-1].stop == index:
            runs[-1] = BlockRun(runs[-1].start, index + 1, counted)
        else:
            runs.append(BlockRun(index, index + 1, counted))
    return GroupedInventory(
        _counted([t for t in tensors if t.section == "first"], frozen),
        tuple(runs),
        _counted([t for t in tensors if t.section == "last"], frozen),
        len(blocks),
    )


def held(inventory: GroupedInventory, plan: PipelinePlan | None, pp_rank: int) -> Counted:
    """The distinct tensors pipeline rank ``pp_rank``'s stages hold (all without a pipeline),
    with their counts and whether they train."""
    if plan is None:
        ranges, has_first, has_last = [range(inventory.n_blocks)], True, True
    else:
        stages = plan.local_stages(pp_rank)
        ranges = [plan.stage_blocks(stage) for stage in stages]
        has_first, has_last = 0 in stages, plan.num_stages - 1 in stages
    tensors: list[tuple[ParamTensor, int, bool]] = []
    for blocks in ranges:
        for run in inventory.runs:
            overlap = min(run.stop, blocks.stop) - max(run.start, blocks.start)
            if overlap > 0:
                tensors += [(t, n * overlap, trains) for t, n, trains in run.tensors]
    if has_first:
        tensors += inventory.first
    if has_last:
        tensors += inventory.last
    return tuple(tensors)


def local_shape(tensor: ParamTensor, dims: ParallelDims, tp_rank: int) -> list[int]:
    """The tensor's shape on this rank after TP and EP (before FSDP)."""
    shape = list(tensor.shape)
    if tensor.expert:
        shape[0] //= dims.ep
    elif dims.tp > 1 and tensor.tp == COLUMN:
        shape[0] = chunk_rows(shape[0], dims.tp, tp_rank)
    elif dims.tp > 1 and tensor.tp == ROW:
        shape[1] = chunk_rows(shape[1], dims.tp, tp_rank)
    return shape


def fsdp_shard(tensor: ParamTensor, shape: list[int], dims: ParallelDims, n_experts: int) -> int:
    """Elements of FSDP2 shard 0 of a tensor of local ``shape``: ``ceil(rows / shards)`` rows.
    (FSDP2 gives rank r rows [r * that, (r + 1) * that), padding the rows past the end.)"""
    if tensor.expert:
        shards = dims.efsdp
        dim = 1 if dims.efsdp * dims.ep > n_experts else 0
    else:
        shards, dim = dims.dp_shard * dims.cp, 0
    rest = math.prod(shape[:dim] + shape[dim + 1 :])
    return math.ceil(shape[dim] / shards) * rest


def state_bytes(
    inventory: GroupedInventory,
    dims: ParallelDims,
    plan: PipelinePlan | None,
    strategy: str,
    bf16: bool,
    n_experts: int,
    pp_rank: int = 0,
    tp_rank: int = 0,
) -> StateBytes:
    """The parameter, gradient and optimizer-state bytes of pipeline rank ``pp_rank``, TP rank
    ``tp_rank``, FSDP shard 0."""
    fsdp = uses_fsdp(dims, strategy, bf16)
    params = grads = optimizer = 0
    for tensor, count, trains in held(inventory, plan, pp_rank):
        shape = local_shape(tensor, dims, tp_rank)
        local = fsdp_shard(tensor, shape, dims, n_experts) if fsdp else math.prod(shape)
        params += count * local * FP32
        if trains:  # a frozen tensor has no gradient and no optimizer state
            grads += count * local * FP32
            optimizer += count * (ADAM_MOMENTS * local + 1) * FP32
    return StateBytes(params, grads, optimizer)


def checkpoint_bytes(
    tensors: list[ParamTensor], frozen: frozenset[str], referenced: frozenset[str]
) -> int:
    """The tensor bytes of one checkpoint, whatever the layout (it holds one copy): each
    trained tensor's fp32 weight and AdamW moments, each frozen one's weight, nothing of those
    held by reference (a pretrained part's, ``checkpoint.by_reference``)."""
    per_element = {True: FP32 * (1 + ADAM_MOMENTS), False: FP32}
    return sum(
        0 if t.name in referenced else t.numel * per_element[t.name not in frozen] for t in tensors
    )
