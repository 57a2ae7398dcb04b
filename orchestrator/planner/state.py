"""Bytes of parameters, gradients and optimizer states one rank holds under a layout.

Exact, not estimated: it follows each tensor through TP, EP, PP and FSDP2 as the trainer places
it (``train.models.inventory``) and counts what the trainer allocates for it:

- parameters: fp32 (FSDP2's mixed precision keeps fp32 shards and casts to bf16 per use); an
  FSDP2 shard is allocated padded to ``ceil(n / shards)`` rows;
- gradients: fp32, the shapes of the parameters (FSDP2 reduce-scatters into padded shards);
- AdamW (fused): two fp32 moments per parameter in its unpadded local shape, and one fp32
  step count per tensor.

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
from train.parallel_dims import ParallelDims
from train.pipeline_plan import PipelinePlan

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


@dataclass(frozen=True)
class GroupedInventory:
    """The inventory as distinct tensors with their counts: the encoder and embeddings (stage
    0), one LLM block (every block has the same tensors), the head (the last stage)."""

    first: tuple[tuple[ParamTensor, int], ...]
    block: tuple[tuple[ParamTensor, int], ...]
    last: tuple[tuple[ParamTensor, int], ...]
    n_blocks: int

    @property
    def block_numel(self) -> int:
        return sum(t.numel * n for t, n in self.block)

    @property
    def numel(self) -> int:
        parts = (self.first, self.last)
        return (
            sum(t.numel * n for part in parts for t, n in part) + self.n_blocks * self.block_numel
        )


def group(tensors: list[ParamTensor]) -> GroupedInventory:
    def counted(section: str, block: int | None = None) -> tuple[tuple[ParamTensor, int], ...]:
        counts: dict[tuple, list] = {}
        for t in tensors:
            if t.section == section and (block is None or t.block == block):
                key = (t.shape, t.tp, t.expert)
                counts.setdefault(key, [t, 0])[1] += 1
        return tuple((t, n) for t, n in counts.values())

    n_blocks = len({t.block for t in tensors if t.section == "block"})
    return GroupedInventory(counted("first"), counted("block", 0), counted("last"), n_blocks)


def held(
    inventory: GroupedInventory, plan: PipelinePlan | None, pp_rank: int
) -> list[tuple[ParamTensor, int]]:
    """The distinct tensors pipeline rank ``pp_rank``'s stages hold (all without a pipeline),
    with their counts."""
    if plan is None:
        blocks, has_first, has_last = inventory.n_blocks, True, True
    else:
        stages = plan.local_stages(pp_rank)
        blocks = sum(plan.split[stage] for stage in stages)
        has_first, has_last = 0 in stages, plan.num_stages - 1 in stages
    tensors = [(t, n * blocks) for t, n in inventory.block]
    if has_first:
        tensors += inventory.first
    if has_last:
        tensors += inventory.last
    return tensors


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
    for tensor, count in held(inventory, plan, pp_rank):
        shape = local_shape(tensor, dims, tp_rank)
        local = fsdp_shard(tensor, shape, dims, n_experts) if fsdp else math.prod(shape)
        params += count * local * FP32
        grads += count * local * FP32
        optimizer += count * (ADAM_MOMENTS * local + 1) * FP32
    return StateBytes(params, grads, optimizer)
