"""Activation memory of one training step on one rank, by formula.

Counted from what the model's autograd graph saves (``train/models/salm.py``), per position:

- a transformer block of width h, KV width kv, FFN width f, ``heads`` heads, with no activation
  checkpointing, saves 8h + 2kv + 4f elements (its input and its two RMSNorms' inputs,
  normalized values and outputs; q, k, v and the attention output; the SwiGLU's two
  projections, its SiLU and their product) and heads + 2 fp32 values (attention's log-sum-exp,
  the norms' reciprocal RMS). ``full`` checkpointing keeps the input and attention's output
  (2h, + heads); ``selective`` also the matmuls' outputs (5h + 2kv + 2f, + heads);
- under TP with sequence parallelism everything but the gathered norm outputs (2h) divides by
  tp; under CP the block holds its 1/cp of the positions but whole K and V (gathered);
- the audio encoder's convolutions save, per fbank frame, the frame (n_mels) and two copies of
  each convolution's output: 2C x mel/2 per conv1 row (one row per 2 frames) and 2C x mel/4 per
  conv2 row (one per 4 frames); the encoder is neither TP- nor CP-split;
- the head saves the final norm's tensors (3d) and the log-probabilities (vocab, fp32 on CPU,
  the logits' dtype on GPU); the loss briefly holds the logits too.

The peak is the largest of four moments: the end of the forward (everything saved plus the
logits); recomputing one LLM block in the backward (under checkpointing); recomputing one
encoder block; and the convolutions' backward (their saved tensors plus the gradients of
conv2's output). A pipeline stage holds the activations of the microbatches in flight: all of
them for gpipe, ``pp - stage`` for 1f1b (stage 0 the most), and for interleaved 1f1b pp times
``1 + (pp - 1) / (pp * v)`` (Narayanan et al., 2021).

Validated against PyTorch's memory tracker (``MemTracker``, activation + temporary bytes at the
step's peak) on CPU in fp32 for the tiny and small presets (tests/test_planner_activations.py;
docs/planner.md gives the errors). bf16 on a GPU halves the element size; no GPU measurement
has checked that yet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from train.models.shape import SALMConfig, encoder_lens, subsampled_lens

FP32 = 4
SEQ_MULTIPLE = 8  # the trainer packs sequences to a multiple of this (times 2cp x tp)


@dataclass(frozen=True)
class Microbatch:
    """One microbatch on one data-parallel rank: ``sequences`` of ``frames`` fbank frames (100
    per second of audio) and ``tokens`` transcript tokens each."""

    sequences: int
    frames: int
    tokens: int

    @property
    def audio_positions(self) -> int:
        return encoder_lens(self.frames)

    def decoder_positions(self, multiple: int = SEQ_MULTIPLE) -> int:
        return math.ceil((self.audio_positions + self.tokens) / multiple) * multiple


@dataclass(frozen=True)
class ActivationLayout:
    """What of the layout shapes activations."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    stages_per_rank: int = 1
    schedule: str = "1f1b"
    microbatches: int = 1  # per optimizer step and data-parallel rank (pipeline or accumulation)
    ac: str = "none"
    element_bytes: int = FP32  # 2 for bf16 compute on a GPU


def block_bytes(h: int, kv: int, f: int, heads: int, ac: str, tp: int, e: int) -> float:
    """Bytes one block saves per position (per position of this rank under CP: K/V apart)."""
    if ac == "full":
        return 2 * h / tp * e + heads / tp * FP32
    if ac == "selective":
        return (5 * h + 2 * kv + 2 * f) / tp * e + heads / tp * FP32
    return ((6 * h + 2 * kv + 4 * f) / tp + 2 * h) * e + (heads / tp + 2) * FP32


def moe_ffn_bytes(cfg: SALMConfig, ac: str, e: int) -> float:
    """Per position, an MoE FFN in place of the dense one: the router's logits and each of the
    top-k copies through an expert (its input, two projections, SiLU, product, output)."""
    if ac == "full":
        return 0.0
    per_copy = cfg.d_model * 2 + 4 * cfg.moe_hidden
    return (cfg.n_experts * FP32) + cfg.top_k * per_copy * e


def in_flight(layout: ActivationLayout) -> float:
    """Microbatches whose activations the busiest pipeline rank (stage 0) holds at once."""
    m, pp = layout.microbatches, layout.pp
    if pp == 1:
        return 1.0
    if layout.schedule == "gpipe":
        return float(m)
    if layout.schedule == "interleaved_1f1b":
        v = layout.stages_per_rank
        return min(float(m), pp * (1 + (pp - 1) / (pp * v)))
    return float(min(m, pp))


@dataclass(frozen=True)
class ActivationBytes:
    encoder: float  # saved by the encoder (and projector) per microbatch
    llm: float  # saved by this rank's LLM blocks and head per microbatch
    peak: float  # the step's activation peak on this rank


def activation_bytes(
    cfg: SALMConfig,
    batch: Microbatch,
    layout: ActivationLayout,
    blocks: int | None = None,
    has_encoder: bool = True,
    has_head: bool = True,
) -> ActivationBytes:
    """This rank's activation bytes: ``blocks`` LLM blocks (all by default), with or without
    the encoder (pipeline stage 0) and the head (the last stage)."""
    e, ac, tp, cp = layout.element_bytes, layout.ac, layout.tp, layout.cp
    b = batch.sequences
    blocks = cfg.n_layers if blocks is None else blocks
    frames, half, quarter = batch.frames, subsampled_lens(batch.frames), batch.audio_positions
    mel_half, mel_quarter = subsampled_lens(cfg.n_mels), encoder_lens(cfg.n_mels)
    c, d = cfg.enc_dim, cfg.d_model
    conv = b * e * (frames * cfg.n_mels + 2 * c * mel_half * half + 2 * c * mel_quarter * quarter)
    enc_args = (c, c, cfg.enc_ffn_hidden, cfg.enc_heads)
    enc_block = b * quarter * block_bytes(*enc_args, ac, 1, e)
    enc_block_full = b * quarter * block_bytes(*enc_args, "none", 1, e)
    encoder = conv + cfg.enc_layers * enc_block + b * quarter * (3 * c + 2 * d) * e
    if not has_encoder:
        conv = encoder = enc_block_full = 0.0

    positions = batch.decoder_positions(SEQ_MULTIPLE * 2 * cp * tp if cp > 1 else SEQ_MULTIPLE * tp)
    local = positions / cp
    kv = cfg.n_kv_heads * (d // cfg.n_heads)
    f = 0 if cfg.n_experts else cfg.ffn_hidden
    per_position = block_bytes(d, kv, f, cfg.n_heads, ac, tp, e)
    per_position_full = block_bytes(d, kv, f, cfg.n_heads, "none", tp, e)
    if cfg.n_experts:
        per_position += moe_ffn_bytes(cfg, ac, e) / tp
        per_position_full += moe_ffn_bytes(cfg, "none", e) / tp
    gathered_kv = (cp - 1) / cp * positions * 2 * kv / tp * e if cp > 1 else 0.0
    llm_block = b * (local * per_position + gathered_kv)
    llm_block_full = b * (local * per_position_full + gathered_kv)
    head = b * local * (3 * d / tp * e + cfg.vocab_size * FP32) if has_head else 0.0
    logits = b * local * cfg.vocab_size * e if has_head else 0.0
    llm = blocks * llm_block + head

    held = in_flight(layout)
    saved = held * (encoder + llm)
    moments = [saved + logits]
    if ac != "none":
        moments.append(saved + llm_block_full)
    if ac != "none" and has_encoder:
        moments.append(held * encoder + (held - 1) * llm + enc_block_full)
    if has_encoder:
        conv_grads = 2 * b * c * mel_quarter * quarter * e
        moments.append((held - 1) * (encoder + llm) + conv + conv_grads)
    return ActivationBytes(encoder=encoder, llm=llm, peak=max(moments))
