"""The SALM's shape and its length arithmetic, without torch.

The planner (``orchestrator.planner``) reads model shapes and presets from here, so that
``orchestrator plan`` answers without importing torch; the model itself is ``train.models.salm``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PAD_ID, BOS_ID, EOS_ID = 256, 257, 258
VOCAB_SIZE = 259


@dataclass(frozen=True)
class SALMConfig:
    n_mels: int = 80
    enc_dim: int = 64
    enc_layers: int = 2
    enc_heads: int = 4
    enc_ffn_hidden: int = 128
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 128
    n_experts: int = 0
    top_k: int = 2
    moe_hidden: int = 64
    aux_loss_coef: float = 0.01
    vocab_size: int = VOCAB_SIZE
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # What pretrained decoder families need (train/models/hf_config.py reads them from config.json).
    head_dim: int = 0  # the LLM's attention head width; 0: d_model // n_heads
    qkv_bias: bool = False  # q, k and v projections with biases (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    tie_embeddings: bool = False  # the output head is the embedding matrix
    # LoRA adapters (train/models/lora.py): our projection names inside each LLM block.
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.d_model % self.n_heads and not self.head_dim) or self.enc_dim % self.enc_heads:
            raise ValueError("d_model and enc_dim must be multiples of their head counts")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, n_experts={self.n_experts}]")
        if self.n_experts and (self.d_model % 8 or self.moe_hidden % 8):
            # torch._grouped_mm needs 16-byte aligned rows, in bf16 as in fp32.
            raise ValueError("an MoE model needs d_model and moe_hidden to be multiples of 8")


def llm_head_dim(cfg: SALMConfig) -> int:
    """The width of one LLM attention head."""
    return cfg.head_dim or cfg.d_model // cfg.n_heads


def subsampled_lens(lens: torch.Tensor | int) -> torch.Tensor | int:
    """Frames left after one stride-2 conv with kernel 3 and padding 1."""
    return (lens - 1) // 2 + 1


def encoder_lens(lens: torch.Tensor | int) -> torch.Tensor | int:
    """Audio positions the encoder hands the LLM for ``lens`` frames (two stride-2 convs)."""
    return subsampled_lens(subsampled_lens(lens))
