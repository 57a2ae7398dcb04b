"""Named model sizes, the one table of them: what ``model.preset`` builds and what
``orchestrator plan --model`` prices (their FLOPs for MFU are counted in ``train.flops``).

The large ones put a public LLM's decoder (Llama 3.1 8B, 70B and 405B: layers, width, heads,
KV heads, FFN width, vocabulary) behind a FastConformer-sized audio encoder (1024 wide, 24
blocks), the way NeMo's SALM pairs Canary's encoder with an LLM: shapes to plan a cluster for,
or to train from scratch on one.
"""

from __future__ import annotations

import dataclasses

from train.models.hf_config import decoder_fields
from train.models.hf_encoder_config import encoder_fields
from train.models.shape import SALMConfig

_FASTCONFORMER = {"enc_dim": 1024, "enc_layers": 24, "enc_heads": 8, "enc_ffn_hidden": 4096}
_LLAMA_VOCAB = 128256
# Llama 3.2 1B's decoder as torchtitan's "1B" flavour builds it (FFN 8192: its multiple_of 1024
# rule at 1.5x; a tied head): what bench/bench_torchtitan.py compares, no preset of its own.
LLAMA_3_2_1B_DECODER = {
    "d_model": 2048,
    "n_layers": 16,
    "n_heads": 32,
    "n_kv_heads": 8,
    "ffn_hidden": 8192,
    "vocab_size": _LLAMA_VOCAB,
    "rope_theta": 500000.0,
    "tie_embeddings": True,
}

PRESETS: dict[str, SALMConfig] = {
    # CPU tests: a few seconds per step on one core.
    "tiny": SALMConfig(),
    "tiny_moe": SALMConfig(n_experts=4, top_k=2, moe_hidden=64),
    # CPU pipeline tests: enough LLM blocks for two stages on each of two ranks.
    "tiny_deep": SALMConfig(n_layers=4),
    # CPU layout tests: 4 KV heads so that tp=4 divides them, 6 LLM blocks for 3 pipeline ranks
    # of 2 virtual stages each.
    "tiny_layouts": SALMConfig(n_layers=6, n_kv_heads=4),
    # CPU sweeps: big enough for learning curves to differ between settings.
    "small": SALMConfig(
        enc_dim=192,
        enc_layers=4,
        enc_heads=4,
        enc_ffn_hidden=512,
        d_model=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        ffn_hidden=704,
    ),
    # GPU benchmarks: a ~1B-parameter LLM (TinyLlama's shape) behind a small encoder.
    "llm_1b": SALMConfig(
        enc_dim=512,
        enc_layers=6,
        enc_heads=8,
        enc_ffn_hidden=2048,
        d_model=2048,
        n_layers=22,
        n_heads=16,
        n_kv_heads=8,
        ffn_hidden=5632,
    ),
    # GPU benchmarks: ~1B parameters in total, ~0.35B active per token.
    "moe_1b": SALMConfig(
        enc_dim=512,
        enc_layers=6,
        enc_heads=8,
        enc_ffn_hidden=2048,
        d_model=1024,
        n_layers=16,
        n_heads=16,
        n_kv_heads=8,
        n_experts=8,
        top_k=2,
        moe_hidden=2816,
    ),
    # Planning: Llama 3.1's decoders behind a FastConformer encoder.
    "llama_8b": SALMConfig(
        **_FASTCONFORMER,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=14336,
        vocab_size=_LLAMA_VOCAB,
    ),
    "llama_70b": SALMConfig(
        **_FASTCONFORMER,
        d_model=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_hidden=28672,
        vocab_size=_LLAMA_VOCAB,
    ),
    "llama_405b": SALMConfig(
        **_FASTCONFORMER,
        d_model=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_hidden=53248,
        vocab_size=_LLAMA_VOCAB,
    ),
}


def get_preset(name: str) -> SALMConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}: choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def model_shape(
    preset: str,
    pretrained_llm: str | None = None,
    pretrained_encoder: str | None = None,
    projector_stride: int = 1,
) -> SALMConfig:
    """The model a config builds: the preset, with its LLM replaced by the pretrained decoder's
    shape when ``model.pretrained_llm`` names one and its encoder by the pretrained encoder's
    when ``model.pretrained_encoder`` does (read from their config.json, no torch), and the
    projector's stride."""
    fields: dict = {"projector_stride": projector_stride}
    if pretrained_llm is not None:
        fields.update(decoder_fields(pretrained_llm))
    if pretrained_encoder is not None:
        fields.update(encoder_fields(pretrained_encoder))
    return dataclasses.replace(get_preset(preset), **fields)
