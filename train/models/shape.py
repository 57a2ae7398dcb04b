"""The SALM's shape and its length arithmetic, without torch.

The planner (``orchestrator.planner``) reads model shapes and presets from here, so that
``orchestrator plan`` answers without importing torch; the model itself is ``train.models.salm``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    Lengths = int | float | torch.Tensor

PAD_ID, BOS_ID, EOS_ID = 256, 257, 258
VOCAB_SIZE = 259
# The audio encoder: the project's own (``AudioEncoder``), or a pretrained Hugging Face family.
OWN_ENCODER = "own"
ENCODERS = (OWN_ENCODER, "whisper", "parakeet")


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
    # A pretrained encoder (train/models/hf_encoder_config.py reads these from the config.json
    # in encoder_dir, with n_mels and the enc_* widths above; the module is built from it).
    encoder: str = OWN_ENCODER  # one of ENCODERS
    encoder_dir: str | None = None
    enc_subsampling: int = 4  # feature frames per encoder frame: stride-2 convolutions in a row
    enc_positions: int = 0  # Whisper: rows of its position table (encoder frames it takes)
    enc_conv_channels: int = 0  # Parakeet: channels of its subsampling convolutions
    enc_conv_kernel: int = 0  # Parakeet: width of each block's depthwise convolution
    enc_bias: bool = False  # Parakeet: biases in its attention and feed-forward projections
    enc_conv_bias: bool = False  # Parakeet: biases in its convolution modules
    projector_stride: int = 1  # encoder frames stacked into one LLM audio position

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
        if self.encoder not in ENCODERS:
            raise ValueError(f"encoder={self.encoder!r}: choose one of {', '.join(ENCODERS)}")
        if (self.encoder == OWN_ENCODER) != (self.encoder_dir is None):
            raise ValueError("a pretrained encoder needs its encoder_dir, the own encoder none")
        halvings = self.enc_subsampling.bit_length() - 1
        if self.enc_subsampling < 2 or self.enc_subsampling != 2**halvings:
            raise ValueError(f"enc_subsampling={self.enc_subsampling}: a power of two is needed")
        if self.encoder == OWN_ENCODER and self.enc_subsampling != 4:
            raise ValueError("the own encoder subsamples by 4 (two stride-2 convolutions)")
        if self.projector_stride < 1:
            raise ValueError(f"model.projector_stride={self.projector_stride} must be >= 1")


def llm_head_dim(cfg: SALMConfig) -> int:
    """The width of one LLM attention head."""
    return cfg.head_dim or cfg.d_model // cfg.n_heads


def subsampled_lens(lens: Lengths, times: int = 1) -> Lengths:
    """Frames left after ``times`` stride-2 convolutions with kernel 3 and padding 1 (every
    encoder family subsamples with these)."""
    for _ in range(times):
        lens = (lens - 1) // 2 + 1
    return lens


def encoder_frames(cfg: SALMConfig, lens: Lengths) -> Lengths:
    """Frames the encoder outputs for ``lens`` feature frames."""
    return subsampled_lens(lens, cfg.enc_subsampling.bit_length() - 1)


def stacked(frames: Lengths, stride: int) -> Lengths:
    """Groups of ``stride`` consecutive frames, the last one possibly short (ceil division)."""
    return (frames + stride - 1) // stride


def audio_positions(cfg: SALMConfig, lens: Lengths) -> Lengths:
    """Audio positions the LLM gets for ``lens`` feature frames: the encoder's frames, stacked
    by the projector. Numbers (the planner) or tensors of lengths alike."""
    return stacked(encoder_frames(cfg, lens), cfg.projector_stride)
