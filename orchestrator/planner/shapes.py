"""Model shapes the planner knows by name: the trainer's presets and common LLM sizes.

The large shapes put a public LLM's decoder (Llama 3.1 8B and 70B, Llama 3.1 405B: layers,
width, heads, KV heads, FFN width, vocabulary) behind a FastConformer-sized audio encoder
(1024 wide, 24 blocks), the way NeMo's SALM pairs Canary's encoder with an LLM. Any other shape
is given flag by flag (``orchestrator plan --help``).
"""

from __future__ import annotations

from dataclasses import replace

from train.models.presets import PRESETS
from train.models.shape import SALMConfig

_ENCODER = {"enc_dim": 1024, "enc_layers": 24, "enc_heads": 8, "enc_ffn_hidden": 4096}
_LLAMA_VOCAB = 128256

LLM_SHAPES: dict[str, SALMConfig] = {
    "llama_8b": SALMConfig(
        **_ENCODER,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=14336,
        vocab_size=_LLAMA_VOCAB,
    ),
    "llama_70b": SALMConfig(
        **_ENCODER,
        d_model=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_hidden=28672,
        vocab_size=_LLAMA_VOCAB,
    ),
    "llama_405b": SALMConfig(
        **_ENCODER,
        d_model=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_hidden=53248,
        vocab_size=_LLAMA_VOCAB,
    ),
}


def model_names() -> list[str]:
    return [*PRESETS, *LLM_SHAPES]


def model_preset(name: str) -> SALMConfig:
    if name in PRESETS:
        return PRESETS[name]
    if name in LLM_SHAPES:
        return LLM_SHAPES[name]
    raise ValueError(f"unknown model {name!r}: choose one of {', '.join(model_names())}")


def with_overrides(cfg: SALMConfig, **fields: int | None) -> SALMConfig:
    """``cfg`` with the given shape fields replaced (None leaves a field as it is)."""
    return replace(cfg, **{key: value for key, value in fields.items() if value is not None})
