"""The one map between the project's parameter names and a Hugging Face decoder's (Llama, Qwen2,
Qwen3), torch-free: loading (``train.models.hf_weights``), export (``train.export``), LoRA's
target modules (``train.models.lora``) and the planner all read it here.
"""

from __future__ import annotations

import re

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
BLOCK_PATTERN = re.compile(r"^llm\.layers\.(\d+)\.(.+)$")


def hf_name(name: str) -> str | None:
    """The Hugging Face name of our parameter ``name`` (canonical, as a plain model has it);
    None for what is not the LLM's (the encoder, the projector)."""
    if name in OUTER_NAMES:
        return OUTER_NAMES[name]
    match = BLOCK_PATTERN.match(name)
    if match is None:
        return None
    inner = BLOCK_NAMES.get(match.group(2))
    if inner is None:
        raise KeyError(f"{name}: no Hugging Face counterpart (an option the family lacks?)")
    return f"model.layers.{match.group(1)}.{inner}"


# A Hugging Face projection's module name (q_proj, ..., down_proj) -> ours inside a block.
PROJECTIONS = {
    hf.split(".")[1]: ours.removesuffix(".weight")
    for ours, hf in BLOCK_NAMES.items()
    if hf.endswith("_proj.weight")
}


def hf_module(module: str) -> str:
    """The Hugging Face name of a block's projection (``attn.wq`` -> ``self_attn.q_proj``)."""
    return BLOCK_NAMES[f"{module}.weight"].removesuffix(".weight")
