"""Faults a test asks for (``debug.inject_nonfinite_steps``, ``debug.inject_nonfinite_params``),
so that the non-finite guards are exercised end to end through a real step: a NaN gradient
after the backward, or an infinite parameter after the update, on rank 0 at the named steps."""

from __future__ import annotations

import torch
from torch import nn

from train.config import DebugConfig
from train.models.moe import local_shard


class InjectedFaults:
    """The step's hooks for the injected faults; nothing happens at other steps or ranks."""

    def __init__(self, debug: DebugConfig, rank: int) -> None:
        self.nan_gradient_at = set(debug.inject_nonfinite_steps) if rank == 0 else set()
        self.inf_parameter_at = set(debug.inject_nonfinite_params) if rank == 0 else set()

    def after_backward(self, step: int, model: nn.Module) -> None:
        """A NaN in the first gradient at ``step`` (1-based): the step must be skipped."""
        if step in self.nan_gradient_at:
            grad = next(p.grad for p in model.parameters() if p.grad is not None)
            local_shard(grad).fill_(float("nan"))

    def after_update(self, step: int, model: nn.Module) -> None:
        """An infinite first parameter after ``step``'s update, as an overflowing update would
        leave it: the next save must refuse it."""
        if step in self.inf_parameter_at:
            with torch.no_grad():
                local_shard(next(model.parameters())).fill_(float("inf"))
