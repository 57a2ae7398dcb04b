"""Activation memory of one training step on one rank, by formula.

Counted from what the model's autograd graph saves (``train/models/salm.py``), per position:

- a transformer block of width h, KV width kv, FFN width f, ``heads`` heads, with no activation
  checkpointing, saves 8h + 2kv + 4f elements (its input and its two RMSNorms' inputs,
  normalized values and outputs; q, k, v and the attention output; the SwiGLU's two
  projections, its SiLU and their product) and heads + 2 fp32 values (attention's log-sum-exp,
  the norms' reciprocal RMS). ``full`` checkpointing keeps the input and attention's output
  (2h, + heads); ``selective`` also the matmuls' outputs (5h + 2kv + 2f, + heads);
- under TP with sequence parallelism everything but the gathered norm outputs (2h) divides by
  tp; under CP the block holds its 1/cp of the positions, and K and V of the whole sequence
  instead of its own: twice without checkpointing (the all-gather's output, and its copy in
  sequence order, which ``index_copy`` saves), once with it; attention's output is copied once
  more (transposed back from the two chunks' concatenation);
- the audio encoder's convolutions save, per fbank frame, the frame (n_mels) and two copies of
  each convolution's output: 2C x mel/2 per conv1 row (one row per 2 frames) and 2C x mel/4 per
  conv2 row (one per 4 frames); the encoder is neither TP- nor CP-split; the gathers that
  assemble each sequence keep the projected audio and the embedded text (d per audio position
  and per token);
- the head saves the final norm's tensors (its input and normalized value, split by TP, and
  its output, gathered whole) and the log-probabilities (vocab, fp32: the loss casts).

The peak is the largest of these moments: the loss's backward (everything saved, plus the
gradients of the log-probabilities and of the logits, fp32; a pipeline's last stage also keeps
its output logits for the schedule's backward); a block's backward (everything saved but the
head's, plus the gradient arriving at the FFN and the FFN's two largest gradients, d + 2f);
under checkpointing the same with one LLM block recomputed, and one encoder block recomputed;
and the convolutions' backward (their saved tensors plus the gradients of conv2's output). A
pipeline stage holds the activations of the microbatches in flight: all of them for gpipe,
``pp - stage`` for 1f1b (stage 0 the most), and for interleaved 1f1b
``((v - 1) pp + 2 (pp - 1 - rank) + 1) / v`` of its v virtual stages' microbatches (torch's
warm-up, as in Narayanan et al., 2021).

Validated on CPU in fp32: at one process against PyTorch's memory tracker (``MemTracker``,
activation + temporary bytes at the step's peak) for the tiny and small presets in every
checkpointing mode, and per rank under TP, CP and PP against the bytes the step allocates
(tests/test_planner_activations.py; docs/planner.md gives the errors). bf16 on a GPU halves
the element size; no GPU measurement has checked that yet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from train.models.shape import SALMConfig, encoder_lens, llm_head_dim, subsampled_lens
from train.parallel_dims import BASE_SEQ_MULTIPLE, sequence_multiple

FP32 = 4


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

    def decoder_positions(self, multiple: int = BASE_SEQ_MULTIPLE) -> int:
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


def block_bytes(
    h: int, kv: int, f: int, heads: int, ac: str, tp: int, e: int, context: bool = False
) -> float:
    """Bytes one block saves per position (per position of this rank under CP, where
    ``context``: K and V of the whole sequence apart)."""
    if ac == "full":
        return 2 * h / tp * e + heads / tp * FP32
    if ac == "selective":
        return (5 * h + 2 * kv + 2 * f) / tp * e + heads / tp * FP32
    own = 7 * h if context else 6 * h + 2 * kv  # CP: no K/V of its own, attention copied
    return ((own + 4 * f) / tp + 2 * h) * e + (heads / tp + 2) * FP32


def moe_ffn_bytes(cfg: SALMConfig, ac: str, e: int) -> float:
    """Per position, an MoE FFN in place of the dense one: the router's logits and each of the
    top-k copies through an expert (its input, two projections, SiLU, product, output)."""
    if ac == "full":
        return 0.0
    per_copy = cfg.d_model * 2 + 4 * cfg.moe_hidden
    return (cfg.n_experts * FP32) + cfg.top_k * per_copy * e


def in_flight(layout: ActivationLayout, stage: int = 0) -> float:
    """Microbatches whose activations pipeline rank ``stage`` holds at once (stage 0 the most)."""
    m, pp = layout.microbatches, layout.pp
    if pp == 1:
        return 1.0
    if layout.schedule == "gpipe":
        return float(m)
    if layout.schedule == "interleaved_1f1b":
        v = layout.stages_per_rank
        return min(float(m), ((v - 1) * pp + 2 * (pp - 1 - stage) + 1) / v)
    return float(min(m, pp - stage))


@dataclass(frozen=True)
class ActivationTerms:
    """One microbatch's activation bytes on one rank, by what holds them, and the extra bytes
    of each moment of the step that can make its peak (zero where that moment does not
    happen on this rank)."""

    encoder: float  # saved by the encoder, projector and embeddings
    llm: float  # saved by this rank's LLM blocks and head
    head: float  # of which the head's
    loss_backward: float  # logits' and log-probabilities' gradients (and a stage's output)
    block_backward: float  # gradients inside one block's backward
    block_recompute: float  # one LLM block recomputed in the backward (checkpointing)
    encoder_recompute: float  # one encoder block recomputed in the backward (checkpointing)
    conv_backward: float  # the convolutions' saved tensors and gradients

    def peak(self, held: float) -> float:
        """The step's peak with ``held`` microbatches in flight (``in_flight``)."""
        saved = held * (self.encoder + self.llm)
        moments = [saved - self.head + self.block_backward]
        if self.loss_backward:
            moments.append(saved + self.loss_backward)
        if self.block_recompute:
            moments.append(saved - self.head + self.block_recompute + self.block_backward)
        if self.encoder_recompute:
            moments.append(held * self.encoder + (held - 1) * self.llm + self.encoder_recompute)
        if self.conv_backward:
            moments.append((held - 1) * (self.encoder + self.llm) + self.conv_backward)
        return max(moments)


@dataclass(frozen=True)
class ActivationBytes:
    encoder: float  # saved by the encoder, projector and embeddings per microbatch
    llm: float  # saved by this rank's LLM blocks and head per microbatch
    peak: float  # the step's activation peak on this rank


def activation_terms(
    cfg: SALMConfig, batch: Microbatch, layout: ActivationLayout, part: tuple[int, bool, bool]
) -> ActivationTerms:
    """One microbatch's terms on a rank holding ``part``: its LLM blocks, and whether it has
    the encoder (pipeline stage 0) and the head (the last stage)."""
    blocks, has_encoder, has_head = part
    e, ac, tp, cp = layout.element_bytes, layout.ac, layout.tp, layout.cp
    b = batch.sequences
    frames, half, quarter = batch.frames, subsampled_lens(batch.frames), batch.audio_positions
    c, d, vocab = cfg.enc_dim, cfg.d_model, cfg.vocab_size
    encoder = conv = enc_block_full = conv_grads = 0.0
    if has_encoder:
        mel_half, mel_quarter = subsampled_lens(cfg.n_mels), encoder_lens(cfg.n_mels)
        conv = b * e * (frames * cfg.n_mels + 2 * c * (mel_half * half + mel_quarter * quarter))
        conv_grads = 2 * b * c * mel_quarter * quarter * e
        enc_args = (c, c, cfg.enc_ffn_hidden, cfg.enc_heads)
        enc_block = b * quarter * block_bytes(*enc_args, ac, 1, e)
        enc_block_full = b * quarter * block_bytes(*enc_args, "none", 1, e)
        inputs = b * (quarter + batch.tokens) * d * e  # kept by the gathers building the sequence
        encoder = conv + cfg.enc_layers * enc_block + b * quarter * (3 * c + 2 * d) * e + inputs

    positions = batch.decoder_positions(sequence_multiple(tp, cp))
    local = positions / cp
    kv = cfg.n_kv_heads * llm_head_dim(cfg)
    f = 0 if cfg.n_experts else cfg.ffn_hidden
    context = cp > 1
    per_position = block_bytes(d, kv, f, cfg.n_heads, ac, tp, e, context)
    per_position_full = block_bytes(d, kv, f, cfg.n_heads, "none", tp, e, context)
    if cfg.n_experts:
        per_position += moe_ffn_bytes(cfg, ac, e) / tp
        per_position_full += moe_ffn_bytes(cfg, "none", e) / tp
    whole_kv = positions * 2 * kv / tp * e if context else 0.0
    llm_block = b * (local * per_position + (2 if ac == "none" else 1) * whole_kv)
    llm_block_full = b * (local * per_position_full + 2 * whole_kv)
    ffn = cfg.top_k * cfg.moe_hidden if cfg.n_experts else cfg.ffn_hidden
    head = loss_backward = 0.0
    if has_head:
        head = b * local * ((2 * d / tp + d) * e + vocab * FP32)
        kept = b * local * vocab * e if layout.pp > 1 else 0.0  # the stage's output
        loss_backward = kept + 2 * b * local * vocab * FP32
    checkpointed = ac != "none"
    return ActivationTerms(
        encoder=encoder,
        llm=blocks * llm_block + head,
        head=head,
        loss_backward=loss_backward,
        block_backward=b * local * (d + 2 * ffn / tp) * e,
        block_recompute=llm_block_full if checkpointed else 0.0,
        encoder_recompute=enc_block_full if checkpointed else 0.0,
        conv_backward=conv + conv_grads,
    )


def activation_bytes(
    cfg: SALMConfig,
    batch: Microbatch,
    layout: ActivationLayout,
    blocks: int | None = None,
    has_encoder: bool = True,
    has_head: bool = True,
    stage: int = 0,
) -> ActivationBytes:
    """The activation bytes of pipeline rank ``stage``, holding ``blocks`` LLM blocks (all by
    default), with or without the encoder (stage 0) and the head (the last stage)."""
    part = (cfg.n_layers if blocks is None else blocks, has_encoder, has_head)
    terms = activation_terms(cfg, batch, layout, part)
    return ActivationBytes(terms.encoder, terms.llm, terms.peak(in_flight(layout, stage)))
