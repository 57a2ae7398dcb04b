"""The model's output and its losses: sums, not means, so the trainer normalises them by the
counts of the whole global batch, whatever the split over ranks and microbatches."""

from __future__ import annotations

from typing import NamedTuple

import torch

from train.models.shape import SALMConfig


class SALMOutput(NamedTuple):
    """Sums rather than means, so the trainer can normalize by the global counts.

    A NamedTuple, so that the output is a pytree of its tensors: FSDP2 up to torch 2.11 finds
    the tensors to hook its pre-backward re-gather on with ``tree_flatten``, which sees a plain
    dataclass as one leaf. The root's parameters, resharded after forward, were then never
    gathered again for backward: every bf16 step on a GPU failed in the head's backward with
    ``setStorage: ... storage of size 0`` (torch 2.11, H100, 2026-11-26)."""

    nll_sum: torch.Tensor  # summed next-token loss over this rank's transcript targets
    num_tokens: torch.Tensor  # how many targets that sum covers
    aux_sum: torch.Tensor  # MoE balance loss, weighted, summed over this rank's sequences


def loss_targets(token_lens: torch.Tensor, target_mask: torch.Tensor | None = None) -> torch.Tensor:
    """How many next-token targets a batch holds (the tokens ``target_mask`` marks; the byte
    tokenizer's every token after BOS), from the CPU batch: known before the forward."""
    if target_mask is None:
        return (token_lens - 1).clamp(min=0).sum()
    return target_mask.sum()


def aux_weight(cfg: SALMConfig) -> float:
    """Scale of one block's summed balance loss in the total: the coefficient over the blocks."""
    return cfg.aux_loss_coef / cfg.n_layers


def loss_for_backward(
    out: SALMOutput,
    global_targets: torch.Tensor,
    global_sequences: torch.Tensor,
    gradient_ranks: int,
) -> torch.Tensor:
    """The local loss whose gradient average over ``gradient_ranks`` (data-parallel x
    context-parallel ranks) is the gradient of the global-batch loss: token losses over all
    targets plus the balance loss over all sequences, whatever the counts per rank or per
    microbatch."""
    return (out.nll_sum / global_targets + out.aux_sum / global_sequences) * gradient_ranks
