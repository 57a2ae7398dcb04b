"""LoRA adapters on the LLM's projections, through ``peft``.

``model.lora.rank > 0`` puts peft's LoRA layers on the named projections of every LLM block
(``inject_adapter_in_model`` on our decoder): each target ``W`` becomes ``W x + (alpha / rank)
B A dropout(x)`` with ``A`` (rank, in) drawn as torch's Linear default (peft's own default) and
``B`` (out, rank) zero, so training starts from the pretrained model exactly. The LLM's own
weights are then frozen (``FROZEN_BY_LORA``, beside ``model.freeze``; ``model.unfreeze`` can
release some), the encoder and projector still train.

Names: peft keeps the wrapped layer as ``<module>.base_layer`` (``canonical_name`` drops that
step, so a base weight keeps the name a plain model, a Hugging Face map and the planner use) and
adds ``<module>.lora_A.default.weight`` and ``<module>.lora_B.default.weight``.

Placement under TP (``train.models.parallelize``): a column-parallel base keeps ``A`` whole and
splits ``B`` by rows like itself; a row-parallel base splits ``A`` by columns like itself (its
output reduce-scattered over the sequence like the base's) and keeps ``B`` whole on the
sequence shard. FSDP shards adapters as any parameter. Torch-free at import (the planner reads
the shape rules); peft is imported where adapters are made.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

from train.models.hf_names import PROJECTIONS
from train.models.shape import SALMConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

ADAPTER = "default"  # peft's name for the one adapter
LORA_A, LORA_B = "lora_A", "lora_B"
# The LLM's own parameters (not its adapters): what LoRA leaves frozen.
FROZEN_BY_LORA = rf"^llm\.(?!.*\.(?:{LORA_A}|{LORA_B})\.)"
# model.lora.target_modules when none are named: the attention projections.
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
DEFAULT_ALPHA = 16.0
# The projections of an MoE block's FFN are its experts (no Linear layers to adapt).
_FFN = ("gate_proj", "up_proj", "down_proj")


def with_lora(shape: SALMConfig, rank: int, alpha: float, dropout: float, targets) -> SALMConfig:
    """``shape`` with adapters of ``rank`` on the Hugging Face projection names ``targets``;
    a setting that cannot be meant is one ValueError line naming it."""
    if rank == 0:
        return shape
    if rank < 0:
        raise ValueError(f"model.lora.rank={rank}: give a positive rank, or 0 for no adapters")
    if alpha <= 0:
        raise ValueError(f"model.lora.alpha={alpha}: must be positive (the scale is alpha/rank)")
    if not 0 <= dropout < 1:
        raise ValueError(f"model.lora.dropout={dropout}: must be in [0, 1)")
    if not targets:
        choices = ", ".join(PROJECTIONS)
        raise ValueError(f"model.lora.target_modules is empty; choose from {choices}")
    for target in targets:
        if target not in PROJECTIONS:
            raise ValueError(
                f"model.lora.target_modules: '{target}' is not a projection of the LLM's "
                f"blocks; choose from {', '.join(PROJECTIONS)}"
            )
        if shape.n_experts and target in _FFN:
            raise ValueError(
                f"model.lora.target_modules: '{target}' of an MoE LLM is its experts, which "
                "take no LoRA here; adapt the attention projections (q_proj k_proj v_proj o_proj)"
            )
    ours = tuple(PROJECTIONS[t] for t in PROJECTIONS if t in set(targets))
    return dataclasses.replace(
        shape, lora_rank=rank, lora_alpha=float(alpha), lora_dropout=dropout, lora_targets=ours
    )


def freeze_rules(freeze: list[str], lora_rank: int) -> list[str]:
    """``model.freeze``'s patterns, and the LLM's own weights under LoRA."""
    return [*freeze, *([FROZEN_BY_LORA] if lora_rank else [])]


def adapter_names(module: str) -> tuple[str, str]:
    """The names of ``module``'s A and B matrices (``module`` as a plain model names it)."""
    return f"{module}.{LORA_A}.{ADAPTER}.weight", f"{module}.{LORA_B}.{ADAPTER}.weight"


def adapter_module(name: str) -> tuple[str, str]:
    """The projection an adapter matrix ``name`` belongs to, and which matrix it is."""
    module, rest = name.split(".lora_", 1)
    return module, f"lora_{rest.split('.', 1)[0]}"


def is_adapter(name: str) -> bool:
    return f".{LORA_A}.{ADAPTER}." in name or is_adapter_b(name)


def is_adapter_b(name: str) -> bool:
    return f".{LORA_B}.{ADAPTER}." in name


def scaling(shape: SALMConfig) -> float:
    return shape.lora_alpha / shape.lora_rank


def add_adapters(decoder: nn.Module, shape: SALMConfig) -> None:
    """Wrap the targeted projections of every block of ``decoder`` (the LLM) in peft's LoRA
    layers, on the device the decoder is on (the meta device when the builder makes it)."""
    import peft

    blocks = "|".join(re.escape(module) for module in shape.lora_targets)
    config = peft.LoraConfig(
        r=shape.lora_rank,
        lora_alpha=shape.lora_alpha,
        lora_dropout=shape.lora_dropout,
        target_modules=rf"layers\.\d+\.({blocks})",
    )
    peft.inject_adapter_in_model(config, decoder, adapter_name=ADAPTER)


def merged_weight(
    weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, shape: SALMConfig
) -> torch.Tensor:
    """``weight + (alpha / rank) B A``, computed in fp32: the projection with its adapter."""
    update = (b.float() @ a.float()) * scaling(shape)
    return (weight.float() + update).to(weight.dtype)
