"""How a checkpoint's ranks agree: this rank, the world size, and the few collectives of a save
and a load. Without a process group the process is rank 0 of one, and nothing is exchanged, so
the manager runs unchanged in a plain process."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def global_rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    """The number of ranks that save together (1 without a process group)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def broadcast_from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (on NCCL, after ``torch.cuda.set_device``)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def first_of_ranks(value: Any) -> Any:
    """The first non-None ``value`` of the ranks, in rank order, on every rank (a collective
    that also makes every rank wait for the others)."""
    if not dist.is_initialized():
        return value
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return next((item for item in gathered if item is not None), None)


def collective_device() -> torch.device:
    """Where a flag must be for the default group's all-reduce: NCCL reduces on the GPU only."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_ranks(flag: torch.Tensor) -> bool:
    """Whether ``flag`` (a 0-d bool tensor) holds on every rank: one all-reduce, one read."""
    value = flag.to(collective_device(), torch.float32)
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())
