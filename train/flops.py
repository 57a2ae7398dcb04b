"""Model FLOPs of a training step and the GPU's peak, for an MFU a reader can trust.

A step's FLOPs are counted from the batch's real (unpadded) lengths, summed over its examples,
for the whole model: the audio encoder (the own one's two stride-2 convolutions, their
projection and bidirectional blocks; a pretrained Whisper's or Parakeet's convolutions, blocks
and, for Parakeet, its relative-position attention terms), the projector, and the LLM over each
example's audio positions plus text tokens. A frozen encoder counts as a trained one. Per
matmul weight of shape (n, m) applied to one position: 2*n*m FLOPs forward, twice that backward,
so 6*n*m for training. Attention scores and their weighted sum cost 2 * 2 * P * d forward per
position of a length-P sequence and layer, 12 * d * P for training: sequences count P**2 each
(the PaLM/torchtitan convention: causal masking is not discounted). Padding, norms, softmax and
elementwise work are not counted. Activation recomputation is not counted either: MFU measures
useful model work, so checkpointing lowers it.

Peaks are dense bf16 tensor-core FLOP/s from NVIDIA's datasheets (the GPU table that the
planner prices with, ``contract.gpus``), looked up by the device name that CUDA reports;
``ORCH_PEAK_FLOPS`` overrides (for a GPU missing here, or to measure against a measured matmul
ceiling instead of the datasheet).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from contract.gpus import gpu_of_device
from train.models.shape import (
    OWN_ENCODER,
    SALMConfig,
    audio_positions,
    encoder_frames,
    llm_head_dim,
    subsampled_lens,
)

if TYPE_CHECKING:
    import torch

PEAK_FLOPS_ENV = "ORCH_PEAK_FLOPS"


def peak_flops(device_name: str, environ: Mapping[str, str]) -> float | None:
    """Peak bf16 FLOP/s of one GPU, or None when it is unknown (MFU is then not reported)."""
    if environ.get(PEAK_FLOPS_ENV):
        return float(environ[PEAK_FLOPS_ENV])
    gpu = gpu_of_device(device_name)
    return gpu.peak_bf16_flops if gpu else None


def _block_weights(dim: int, n_heads: int, n_kv_heads: int, head_dim: int, ffn_weights: int) -> int:
    return 2 * dim * n_heads * head_dim + 2 * dim * n_kv_heads * head_dim + ffn_weights


def llm_weights_per_position(cfg: SALMConfig) -> int:
    """LLM matmul weights one position touches: attention, FFN (router and top-k experts for
    MoE), output head. The embedding lookup is not a matmul."""
    if cfg.n_experts:
        ffn = cfg.d_model * cfg.n_experts + cfg.top_k * 3 * cfg.d_model * cfg.moe_hidden
    else:
        ffn = 3 * cfg.d_model * cfg.ffn_hidden
    block = _block_weights(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, llm_head_dim(cfg), ffn)
    return cfg.n_layers * block + cfg.d_model * cfg.vocab_size


def _own_encoder_macs(cfg: SALMConfig, frames):
    """Two stride-2 Conv2d over (time, mel), their projection, then SwiGLU blocks."""
    half, audio = subsampled_lens(frames), encoder_frames(cfg, frames)
    mel_half, mel_quarter = subsampled_lens(cfg.n_mels), subsampled_lens(cfg.n_mels, 2)
    c = cfg.enc_dim
    conv = 9 * c * half * mel_half + 9 * c * c * audio * mel_quarter
    enc_ffn = 3 * c * cfg.enc_ffn_hidden
    enc_block = _block_weights(c, cfg.enc_heads, cfg.enc_heads, c // cfg.enc_heads, enc_ffn)
    enc_matmul = (c * mel_quarter * c + cfg.enc_layers * enc_block) * audio
    return conv + enc_matmul + 2 * cfg.enc_layers * c * audio**2


def _whisper_encoder_macs(cfg: SALMConfig, frames):
    """Conv1d (kernel 3) at the frame rate, then at half of it; blocks of attention and a GELU
    MLP."""
    c, out = cfg.enc_dim, encoder_frames(cfg, frames)
    conv = 3 * cfg.n_mels * c * frames + 3 * c * c * out
    block = 4 * c * c + 2 * c * cfg.enc_ffn_hidden
    return conv + cfg.enc_layers * (block * out + 2 * c * out**2)


def _parakeet_encoder_macs(cfg: SALMConfig, frames):
    """A 3x3 Conv2d, then a depthwise 3x3 and a pointwise one per further halving, their
    projection; FastConformer blocks: two FFNs, attention's projections and the convolution
    module's per frame, and per sequence the relative positions' projection (2P - 1 of them,
    counted as 2P) and the content and position scores besides the weighted sum."""
    c, ch = cfg.enc_dim, cfg.enc_conv_channels
    rows, mels = subsampled_lens(frames), subsampled_lens(cfg.n_mels)
    conv = 9 * ch * rows * mels
    for _ in range(cfg.enc_subsampling.bit_length() - 2):
        rows, mels = subsampled_lens(rows), subsampled_lens(mels)
        conv += (9 * ch + ch * ch) * rows * mels
    conv += ch * (cfg.n_mels // cfg.enc_subsampling) * c * rows
    block = 4 * c * cfg.enc_ffn_hidden + 4 * c * c + 3 * c * c + cfg.enc_conv_kernel * c
    relative = 2 * c * c * rows + 2 * c * rows**2 + 2 * c * rows**2
    return conv + cfg.enc_layers * (block * rows + relative)


ENCODER_MACS = {
    OWN_ENCODER: _own_encoder_macs,
    "whisper": _whisper_encoder_macs,
    "parakeet": _parakeet_encoder_macs,
}


def sequence_flops(cfg: SALMConfig, frames, tokens):
    """Training FLOPs (forward + backward) of sequences of ``frames`` feature frames and
    ``tokens`` transcript tokens: numbers (the planner) or float64 tensors of lengths (one per
    example, or (B, K) frames of each example's K audio segments)."""
    encoder = ENCODER_MACS[cfg.encoder](cfg, frames)
    audio = audio_positions(cfg, frames)
    if getattr(frames, "ndim", 0) == 2:  # (B, K) tensors: each example's audio segments
        encoder, audio = encoder.sum(-1), audio.sum(-1)
    stacked_width = cfg.projector_stride * cfg.enc_dim
    projector = (stacked_width * cfg.d_model + cfg.d_model**2) * audio
    positions = audio + tokens
    llm_matmul = llm_weights_per_position(cfg) * positions
    llm_attn = 2 * cfg.n_layers * cfg.n_heads * llm_head_dim(cfg) * positions**2
    return 6 * (encoder + projector + llm_matmul + llm_attn)


def loss_recompute_flops(cfg: SALMConfig, positions):
    """The FLOPs the loss adds beyond the model's: the head's logits computed again in its
    backward, at every decoder position (train/models/head_loss.py). Not model FLOPs: MFU
    leaves them out, as it leaves out activation checkpointing's recompute."""
    return 2 * cfg.d_model * cfg.vocab_size * positions


def step_flops(cfg: SALMConfig, feature_lens: torch.Tensor, token_lens: torch.Tensor) -> float:
    """Training FLOPs (forward + backward) of one batch, from its CPU length tensors."""
    return float(sequence_flops(cfg, feature_lens.double(), token_lens.double()).sum())
