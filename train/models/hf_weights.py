"""A Hugging Face decoder's weights in the project's own decoder: the one map between their
parameter names, and loading with DCP straight from the safetensors files.

The decoder is the project's (``train/models/salm.py``), not ``transformers``' modeling code, so
that every parallelism, compile, activation checkpointing, the pipeline split and the planner's
inventory keep one code path. Hugging Face checkpoints of these families store q and k already
ordered for the "rotate half" RoPE our attention applies, so weights map one to one, unpermuted.
RoPE's tables are computed at each forward from ``rope_theta`` (no buffer to restore).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from train.models.hf_names import hf_name
from train.models.init import canonical_name
from train.models.lora import is_adapter


def llm_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The LLM's parameters of ``model`` (plain or DTensor shards) under their Hugging Face
    names; a tied output head appears once, as the embedding. LoRA adapters are not among them
    (``train.export`` merges them or writes them apart)."""
    state = {}
    for name, param in model.named_parameters():
        if is_adapter(name):
            continue
        hf = hf_name(canonical_name(name))
        if hf is not None:
            state[hf] = param
    return state


@torch.no_grad()
def load_llm_weights(model: nn.Module, directory: Path) -> None:
    """Fill the LLM's parameters from the safetensors in ``directory``: each rank reads the
    slices its shards hold (DCP's HuggingFaceStorageReader), in the parameters' own dtype."""
    state = llm_state(model)
    dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(directory)))
