"""What one training pass of a model computes, op by op: how the activation checkpointing modes
are told apart by what they recompute."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import train.models.moe  # noqa: F401  (registers torch.ops.salm)
from train.models.batch import Batch
from train.models.init import canonical_name

MATMULS = frozenset(
    {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten._grouped_mm.default,
        torch.ops.salm.grouped_mm_fp32.default,  # the MoE's experts in fp32 (train/models/moe.py)
    }
)


class MatmulCount(TorchDispatchMode):
    """Counts the matmuls that run under it (the forward's, the backward's, and any recompute)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MATMULS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def training_pass(model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, dict, int]:
    """One forward and backward of ``model`` on ``batch``: the loss, every gradient by
    parameter name (as a plain model names it), and how many matmuls ran."""
    with MatmulCount() as counter:
        out = model(batch)
        loss = out.nll_sum + out.aux_sum
        loss.backward()
    grads = {
        canonical_name(name): p.grad.clone()
        for name, p in model.named_parameters()
        if p.grad is not None
    }
    return loss.detach(), grads, counter.count
