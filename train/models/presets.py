"""Named model sizes, and the model FLOPs per token that MFU is computed from."""

from __future__ import annotations

from train.models.salm import SALMConfig

PRESETS: dict[str, SALMConfig] = {
    # CPU tests: a few seconds per step on one core.
    "tiny": SALMConfig(),
    "tiny_moe": SALMConfig(n_experts=4, top_k=2, moe_hidden=64),
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
}


def get_preset(name: str) -> SALMConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}: choose one of {sorted(PRESETS)}")
    return PRESETS[name]


def active_llm_params(cfg: SALMConfig) -> int:
    """LLM weights one token's matmuls touch: attention, FFN (router + top-k experts for MoE),
    norms and output head; the embedding lookup is not a matmul and is left out."""
    head_dim = cfg.d_model // cfg.n_heads
    attn = 2 * cfg.d_model * cfg.n_heads * head_dim + 2 * cfg.d_model * cfg.n_kv_heads * head_dim
    if cfg.n_experts:
        ffn = cfg.d_model * cfg.n_experts + cfg.top_k * 3 * cfg.d_model * cfg.moe_hidden
    else:
        ffn = 3 * cfg.d_model * cfg.ffn_hidden
    norms = 2 * cfg.d_model
    return cfg.n_layers * (attn + ffn + norms) + cfg.d_model + cfg.d_model * cfg.vocab_size


def flops_per_token(cfg: SALMConfig, seq_len: int) -> float:
    """Training FLOPs per decoder position: 6N for the matmuls (forward + backward) plus the
    attention scores, 12 * layers * d_model * seq_len (the PaLM/torchtitan convention).

    The audio encoder is left out: it is small next to the LLM in the GPU presets, so MFU is
    slightly under-reported rather than flattered.
    """
    return 6 * active_llm_params(cfg) + 12 * cfg.n_layers * cfg.d_model * seq_len
