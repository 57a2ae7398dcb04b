"""The forward and backward of one optimizer step over a whole model (the pipeline's own runner
is ``train.models.pipeline.PipelineRunner``; both take the same arguments).

A step may take several batches (``train.grad_accum``): each is a microbatch whose loss is
normalized by the target and sequence counts of the whole step, so the accumulated gradient is
the gradient of one step over all of them together. Gradients are reduced over data-parallel
ranks only on the last microbatch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from train.models.batch import Batch, tensor_to_device
from train.models.encoder_cache import encoder_keys
from train.models.frame_packing import encoder_plan
from train.models.loss import SALMOutput, loss_for_backward
from train.models.packing import example_positions, packed_length
from train.models.salm import SALM


def to_device(batch: Batch, device: torch.device) -> Batch:
    """A CPU batch on ``device``, copied asynchronously from pinned memory on CUDA."""
    return Batch(*(None if t is None else tensor_to_device(t, device) for t in batch))


def host_seq_len(batch: Batch, model: nn.Module) -> int:
    """The batch's packed decoder length in ``model`` (a SALM or a pipeline part: its shape and
    sequence multiple), read from its CPU length tensors (as Python lists) before the batch
    moves to the device: the model needs it as an int, and reading it from the device would be
    a host sync in every microbatch."""
    audio = example_positions(model.cfg, batch.feature_lens).tolist()
    longest = max(a + t for a, t in zip(audio, batch.token_lens.tolist(), strict=True))
    return packed_length(longest, model.seq_multiple)


class WholeModelRunner:
    """Runs every microbatch of a step through one (parallelized) model."""

    def __init__(
        self,
        model: SALM,
        device: torch.device,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> None:
        self.model = model
        self.parts = [model]
        self.device = device
        self.autocast = autocast

    def forward_backward(
        self,
        batches: list[Batch],
        global_targets: torch.Tensor,
        global_sequences: torch.Tensor,
        gradient_ranks: int,
    ) -> torch.Tensor:
        """Forward and backward of each batch (CPU tensors); returns [next-token loss sum,
        weighted balance-loss sum] over all of them."""
        sums = torch.zeros(2, device=self.device)
        for index, batch in enumerate(batches):
            set_gradient_sync(self.model, index == len(batches) - 1)
            with self.autocast():
                out = self.forward(batch)
            loss_for_backward(out, global_targets, global_sequences, gradient_ranks).backward()
            sums += torch.stack([out.nll_sum.detach().float(), out.aux_sum.detach().float()])
        return sums

    @torch.no_grad()
    def loss_sum(self, batch: Batch) -> torch.Tensor:
        """The next-token loss sum of one batch (CPU tensors), forward only (validation)."""
        with self.autocast():
            out = self.forward(batch)
        return out.nll_sum.float()

    def forward(self, batch: Batch) -> SALMOutput:
        """The model's output for one CPU batch: its decoder length and the encoder's plan
        (the segments that hold audio, their packing), or, when the model keeps its encoder's
        outputs, the batch's keys into them (which skip empty segments themselves), are read on
        the host first."""
        seq_len = host_seq_len(batch, self.model)
        keys = plan = None
        if self.model.encoder_cache is not None:
            keys = encoder_keys(batch.features, batch.feature_lens)
        else:
            plan = encoder_plan(self.model.cfg, self.model.encoder, batch.feature_lens)
        return self.model(
            to_device(batch, self.device),
            seq_len=seq_len,
            encoder_keys=keys,
            encoder_plan=None if plan is None else plan.to(self.device),
        )


def set_gradient_sync(model: torch.nn.Module, sync: bool) -> None:
    """Tell FSDP2 or DDP whether this backward reduces gradients (the last microbatch's does)."""
    setter = getattr(model, "set_requires_gradient_sync", None)
    if setter is not None:
        setter(sync)
