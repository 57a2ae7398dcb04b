"""Hugging Face weights in the project's model, loaded with DCP straight from the safetensors
files: a decoder's through the one map between their parameter names, a pretrained audio
encoder's by prefix (``train.models.hf_encoder`` keeps transformers' names under ``encoder.``).

The decoder is the project's (``train/models/salm.py``), not ``transformers``' modeling code, so
that every parallelism, compile, activation checkpointing, the pipeline split and the planner's
inventory keep one code path. Hugging Face checkpoints of these families store q and k already
ordered for the "rotate half" RoPE our attention applies, so weights map one to one, unpermuted.
RoPE's tables are computed at each forward from ``rope_theta`` (no buffer to restore).

An encoder's files may prefix its names (``model.encoder.`` in a WhisperForConditionalGeneration,
``encoder.`` in a WhisperModel or ParakeetForCTC, nothing in a saved encoder): the prefix is the
one under which every name of the model's encoder is stored.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch import nn

from train.models.hf_config import WEIGHT_FILES
from train.models.hf_names import hf_name
from train.models.init import canonical_name
from train.models.lora import is_adapter
from train.models.pretrained_parts import ENCODER_PART, ENCODER_PREFIX, LLM_PART


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


ENCODER_PREFIXES = ("model.encoder.", "encoder.", "")


def encoder_state(model: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """The encoder's parameters of ``model`` (plain or DTensor shards; none on a pipeline stage
    without it) under transformers' names, each after ``prefix``."""
    state = {}
    for name, param in model.named_parameters():
        name = canonical_name(name)
        if name.startswith(ENCODER_PREFIX):
            state[prefix + name.removeprefix(ENCODER_PREFIX)] = param
    return state


def stored_names(directory: Path) -> set[str]:
    """The tensor names in the safetensors of ``directory`` (one file, or an index of shards)."""
    single, index = (directory / name for name in WEIGHT_FILES)
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    with safe_open(single, framework="pt") as weights:
        return set(weights.keys())


@torch.no_grad()
def load_encoder_weights(model: nn.Module, directory: Path) -> None:
    """Fill the pretrained encoder's parameters from the safetensors in ``directory``, as
    ``load_llm_weights`` does the LLM's. Every rank calls it (DCP's load is collective)."""
    names = encoder_state(model)
    stored = stored_names(directory)
    prefix = next((p for p in ENCODER_PREFIXES if all(p + n in stored for n in names)), None)
    if prefix is None:
        missing = sorted(n for n in names if n not in stored)
        raise ValueError(
            f"model.pretrained_encoder={directory}: its weights lack the encoder's "
            f"{missing[0]} (also under {', '.join(p for p in ENCODER_PREFIXES if p)})"
        )
    state = encoder_state(model, prefix)
    dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(directory)))


# Each pretrained part's loader, by its ModelConfig key (train.models.pretrained_parts.PARTS).
PART_LOADERS = {LLM_PART: load_llm_weights, ENCODER_PART: load_encoder_weights}
