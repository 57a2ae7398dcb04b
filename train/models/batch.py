"""One batch as the model reads it: the loader's tensors by name.

A ``NamedTuple`` rather than a dataclass: the pipeline schedule splits a batch into
microbatches and hands each stage its fields positionally, and FSDP2 finds tensors in a
model's inputs and outputs with ``tree_flatten``, which sees into a NamedTuple (a plain dataclass
is one opaque leaf to it). Everything else reads the fields by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch


class Batch(NamedTuple):
    """``features`` (B, K, T, bins) or (B, T, bins) and ``feature_lens`` (B, K) or (B,): each
    example's K audio segments; ``tokens`` (B, L) and ``token_lens`` (B,); for a prompt or a
    conversation, ``audio_at`` (B, K), where each segment goes among the tokens, and
    ``target_mask`` (B, L), the tokens that are targets (None: the byte tokenizer's layout,
    audio first and every token after BOS a target)."""

    features: torch.Tensor
    feature_lens: torch.Tensor
    tokens: torch.Tensor
    token_lens: torch.Tensor
    audio_at: torch.Tensor | None = None
    target_mask: torch.Tensor | None = None

    @classmethod
    def of(cls, loaded: Mapping[str, Any]) -> Batch:
        """The model's fields of a loader's batch (which also holds cut ids, sources, ...)."""
        return cls(*(loaded.get(name) for name in cls._fields))

    def prompt(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``audio_at`` and ``target_mask``, the byte tokenizer's layout where they are None."""
        if self.audio_at is not None and self.target_mask is not None:
            return self.audio_at, self.target_mask
        tokens = self.tokens
        first = torch.arange(tokens.shape[1], device=tokens.device) >= 1
        return tokens.new_zeros((tokens.shape[0], 1)), first[None, :].expand(tokens.shape[0], -1)

    def with_prompt(self) -> Batch:
        """Every field a tensor (the pipeline's stages take a fixed list of them)."""
        audio_at, target_mask = self.prompt()
        return self._replace(audio_at=audio_at, target_mask=target_mask)


def tensor_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on ``device``: from pinned memory on CUDA, so the copy does not wait."""
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
