"""The bytes each rank holds in parameters, gradients and optimizer states, as measured.

Counted over the storages behind each rank's local tensors (a DTensor's local shard; FSDP's
padded shard storage, which is what it really allocates), each storage once: FSDP's gradients
of one group are views of one reduce-scatter buffer. The planner (``orchestrator plan``)
predicts the same three figures for every layout; the ``memory`` record in metrics.jsonl is
what it is checked against.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

STATE_KINDS = ("params_bytes", "grads_bytes", "optimizer_bytes")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``' local parts."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = _local(tensor).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def gradient_bytes(model: nn.Module) -> int:
    return storage_bytes(p.grad for p in model.parameters() if p.grad is not None)


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, grads: int) -> dict[str, int]:
    """This rank's measured parameter, gradient (``grads``, taken while they existed) and
    optimizer-state bytes."""
    states = (
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )
    return {
        "params_bytes": storage_bytes(model.parameters()),
        "grads_bytes": grads,
        "optimizer_bytes": storage_bytes(states),
    }
