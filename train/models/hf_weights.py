"""A Hugging Face decoder's weights in the project's own decoder: the one map between their
parameter names, and loading with DCP straight from the safetensors files.

The decoder is the project's (``train/models/salm.py``), not ``transformers``' modeling code, so
that every parallelism, compile, activation checkpointing, the pipeline split and the planner's
inventory keep one code path. Hugging Face checkpoints of these families store q and k already
ordered for the "rotate half" RoPE our attention applies, so weights map one to one, unpermuted.
RoPE's tables are computed at each forward from ``rope_theta`` (no buffer to restore).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from train.models.init import canonical_name

# Our name inside an LLM block -> the Hugging Face name inside ``model.layers.N``.
BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wq.bias": "self_attn.q_proj.bias",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wk.bias": "self_attn.k_proj.bias",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wv.bias": "self_attn.v_proj.bias",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn.w1.weight": "mlp.gate_proj.weight",
    "ffn.w3.weight": "mlp.up_proj.weight",
    "ffn.w2.weight": "mlp.down_proj.weight",
}
OUTER_NAMES = {
    "llm.embed.weight": "model.embed_tokens.weight",
    "llm.norm.weight": "model.norm.weight",
    "llm.lm_head.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"^llm\.layers\.(\d+)\.(.+)$")


def hf_name(name: str) -> str | None:
    """The Hugging Face name of our parameter ``name`` (canonical, as a plain model has it);
    None for what is not the LLM's (the encoder, the projector)."""
    if name in OUTER_NAMES:
        return OUTER_NAMES[name]
    match = _BLOCK.match(name)
    if match is None:
        return None
    inner = BLOCK_NAMES.get(match.group(2))
    if inner is None:
        raise KeyError(f"{name}: no Hugging Face counterpart (an option the family lacks?)")
    return f"model.layers.{match.group(1)}.{inner}"


def llm_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The LLM's parameters of ``model`` (plain or DTensor shards) under their Hugging Face
    names; a tied output head appears once, as the embedding."""
    state = {}
    for name, param in model.named_parameters():
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
