"""The scan that keeps NaN and inf out of a checkpoint, so that a good checkpoint is never
pruned in favour of a bad one. It costs one x.x per tensor and, on the device, one all-reduced
flag; only when that fails are the tensors searched for one to name."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor

from train.checkpoint.collectives import all_ranks, first_of_ranks, global_rank


def local_tensors(tree: dict, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """The floating-point tensors of a state dict as this rank holds them (DTensor shards)."""
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from local_tensors(value, f"{name}.")
        elif isinstance(value, torch.Tensor) and value.is_floating_point():
            local = value.to_local() if isinstance(value, DTensor) else value
            if local.numel():
                yield name, local


def _extremes(tensor: torch.Tensor) -> torch.Tensor:
    """Min and max (NaN if any element is NaN): finite exactly when every element is."""
    return torch.stack(torch.aminmax(tensor)).float()


def squares_finite(tensors: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """Whether x.x is finite for every tensor (a 0-d bool on their device): one pass each (BLAS,
    ~2x faster than min/max on CPU). x.x is finite exactly when every x is, unless the values are
    so large that it overflows, so only a failure needs ``local_nonfinite``."""
    squares = [torch.dot(t.reshape(-1), t.reshape(-1)).float() for _, t in tensors]
    if not squares:
        return torch.tensor(True, device="cpu")
    return torch.isfinite(torch.stack(squares)).all()


def local_nonfinite(tensors: list[tuple[str, torch.Tensor]]) -> str | None:
    """The first of ``tensors`` with a NaN or inf element, named with this rank, or None."""
    local = next(
        (name for name, t in tensors if not torch.isfinite(_extremes(t)).all().item()), None
    )
    return None if local is None else f"{local} (rank {global_rank()})"


def first_nonfinite(state: dict) -> str | None:
    """The name of a non-finite tensor of ``state`` on any rank (all ranks agree), or None.
    Costs one x.x per tensor and one all-reduced flag on the device (``squares_finite``)."""
    tensors = list(local_tensors(state))
    if all_ranks(squares_finite(tensors)):
        return None
    return first_of_ranks(local_nonfinite(tensors))
