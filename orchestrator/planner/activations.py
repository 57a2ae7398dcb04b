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
  and per token); the projector keeps its two hidden activations (2d per audio position) and,
  stacking frames (stride > 1), its stacked input;
- a pretrained encoder is counted the same way, tensor by tensor, from transformers' layers
  (``train.models.hf_encoder``): Whisper's convolutions save the input frame (n_mels), conv1's
  output twice (before and after GELU) and conv2's once, per frame at their rates; a Whisper
  block saves 9h + 2f per frame without checkpointing (its layer norms' inputs and outputs, q,
  k, v, attention's output and its contiguous copy, the GELU MLP's two activations), 6h + f
  under ``selective`` (its matmuls' and attention's outputs: 7h + f counted, 6h + f measured),
  and its final layer norm 2h. Parakeet's subsampling saves the input frame, the first
  convolution's ReLU output and two tensors per further halving (C channels at each stage's
  time and mel rates) and the flattened C x mel/8 per frame; a FastConformer block saves
  25h + 4f per frame (two FFNs, attention with its biased queries, the projected relative
  positions, the convolution module) plus heads x frames for the position scores (attention's
  bias, a full frames x frames matrix per head), 10h + 2f + 3 heads x frames under
  ``selective`` (the scores' matmuls too), and a block recomputed under checkpointing adds two
  more heads x frames for the scores' gradients. ``full`` keeps 2h per frame for either, as for
  the own blocks. Checked on CPU in fp32 (tiny random encoders, the tiny LLM, two batch shapes,
  every checkpointing mode, projector strides 1 and 2) against ``MemTracker`` as the presets
  are: within 10% (docs/planner.md);
- the head saves the final norm's tensors (its input and normalized value, split by TP, and
  its output, gathered whole) and one fp32 log-sum-exp per position: the loss computes the
  logits a chunk of positions at a time and keeps none (``train/models/head_loss.py``). A
  loss over the full logits (``loss_chunk=0``: torchtitan's, which the published measurements
  ran) keeps the log-probabilities instead (vocab, fp32), and its backward adds the gradients
  of the log-probabilities and of the logits, fp32, a pipeline's last stage its output logits.

The peak is the largest of these moments: the loss's backward (everything saved, plus one
chunk's logits recomputed, fp32, and their cast to the compute dtype, over this rank's
vocabulary rows; the hidden states' gradient; the head's gradient summed in fp32 and one
chunk's product); a block's backward (everything saved but the
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

from train.models.shape import (
    OWN_ENCODER,
    SALMConfig,
    audio_positions,
    encoder_frames,
    llm_head_dim,
    subsampled_lens,
)
from train.parallel.dims import (
    BASE_SEQ_MULTIPLE,
    DEFAULT_LOSS_CHUNK,
    SELECTIVE_OP,
    Degrees,
    sequence_multiple,
)

FP32 = 4


@dataclass(frozen=True)
class Microbatch:
    """One microbatch on one data-parallel rank: ``sequences`` of ``frames`` feature frames (100
    per second of audio) and ``tokens`` transcript tokens each."""

    sequences: int
    frames: int
    tokens: int

    def decoder_positions(self, cfg: SALMConfig, multiple: int = BASE_SEQ_MULTIPLE) -> int:
        positions = audio_positions(cfg, self.frames) + self.tokens
        return math.ceil(positions / multiple) * multiple


@dataclass
class ActivationLayout(Degrees):
    """The layout as activations see it: the degrees (tp, cp and pp shape them) and how the
    pipeline and the microbatches run."""

    stages_per_rank: int = 1
    schedule: str = "1f1b"
    microbatches: int = 1  # per optimizer step and data-parallel rank (pipeline or accumulation)
    ac: str = "none"
    element_bytes: int = FP32  # 2 for bf16 compute on a GPU
    loss_chunk: int = DEFAULT_LOSS_CHUNK  # train.loss_chunk; 0: a loss over the full logits


def block_bytes(
    h: int, kv: int, f: int, heads: int, ac: str, tp: int, e: int, context: bool = False
) -> float:
    """Bytes one block saves per position (per position of this rank under CP, where
    ``context``: K and V of the whole sequence apart)."""
    if ac == "full":
        return 2 * h / tp * e + heads / tp * FP32
    if ac == "selective":
        return (5 * h + 2 * kv + 2 * f) / tp * e + heads / tp * FP32
    if ac == SELECTIVE_OP:  # the input, q, v, attention's output, w1's and w2's
        return (4 * h + kv + f) / tp * e + heads / tp * FP32
    own = 7 * h if context else 6 * h + 2 * kv  # CP: no K/V of its own, attention copied
    return ((own + 4 * f) / tp + 2 * h) * e + (heads / tp + 2) * FP32


def moe_ffn_bytes(cfg: SALMConfig, ac: str, e: int) -> float:
    """Per position, an MoE FFN in place of the dense one: the router's logits and each of the
    top-k copies through an expert (its input, two projections, SiLU, product, output)."""
    if ac == "full":
        return 0.0
    per_copy = cfg.d_model * 2 + 4 * cfg.moe_hidden
    return (cfg.n_experts * FP32) + cfg.top_k * per_copy * e


def _own_encoder_terms(cfg: SALMConfig, frames: int, ac: str, e: int) -> tuple[float, ...]:
    """Per sequence: (bytes saved by the encoder, by its convolutions alone, the convolutions'
    gradients in their backward, one block recomputed in full)."""
    c, half, quarter = cfg.enc_dim, subsampled_lens(frames), encoder_frames(cfg, frames)
    mel_half, mel_quarter = subsampled_lens(cfg.n_mels), subsampled_lens(cfg.n_mels, 2)
    conv = e * (frames * cfg.n_mels + 2 * c * (mel_half * half + mel_quarter * quarter))
    enc_args = (c, c, cfg.enc_ffn_hidden, cfg.enc_heads)
    block = quarter * block_bytes(*enc_args, ac, 1, e)
    saved = conv + cfg.enc_layers * block + quarter * 3 * c * e  # and the final norm's three
    full = quarter * block_bytes(*enc_args, "none", 1, e)
    return saved, conv, 2 * c * mel_quarter * quarter * e, full


def _whisper_block(h: int, f: int, heads: int, ac: str, e: int) -> float:
    """Bytes a Whisper block saves per frame (see the module docstring)."""
    if ac == "full":
        return 2 * h * e + heads * FP32
    if ac == "selective":
        return (6 * h + f) * e + heads * FP32
    return (9 * h + 2 * f) * e + (heads + 4) * FP32


def _whisper_encoder_terms(cfg: SALMConfig, frames: int, ac: str, e: int) -> tuple[float, ...]:
    """As ``_own_encoder_terms``, for Whisper's encoder."""
    c, out = cfg.enc_dim, encoder_frames(cfg, frames)
    conv = e * (frames * cfg.n_mels + 2 * c * frames + c * out)
    block = (c, cfg.enc_ffn_hidden, cfg.enc_heads)
    saved = conv + cfg.enc_layers * out * _whisper_block(*block, ac, e) + out * 2 * c * e
    return saved, conv, 2 * c * frames * e, out * _whisper_block(*block, "none", e)


def _parakeet_block(h: int, f: int, heads: int, frames: int, ac: str, e: int) -> float:
    """Bytes a FastConformer block of Parakeet saves per frame (see the module docstring)."""
    if ac == "full":
        return 2 * h * e + heads * FP32
    if ac == "selective":
        return (10 * h + 2 * f + 3 * heads * frames) * e + heads * FP32
    return (25 * h + 4 * f + heads * frames) * e + (heads + 10) * FP32


def _parakeet_encoder_terms(cfg: SALMConfig, frames: int, ac: str, e: int) -> tuple[float, ...]:
    """As ``_own_encoder_terms``, for Parakeet's encoder."""
    ch, c = cfg.enc_conv_channels, cfg.enc_dim
    rows, mels = subsampled_lens(frames), subsampled_lens(cfg.n_mels)
    first = ch * rows * mels
    conv = frames * cfg.n_mels + first
    for _ in range(cfg.enc_subsampling.bit_length() - 2):
        rows, mels = subsampled_lens(rows), subsampled_lens(mels)
        conv += 2 * ch * rows * mels
    conv = e * (conv + ch * (cfg.n_mels // cfg.enc_subsampling) * rows)
    block = (c, cfg.enc_ffn_hidden, cfg.enc_heads, rows)
    saved = conv + cfg.enc_layers * rows * _parakeet_block(*block, ac, e) + rows * c * e
    # Recomputed for its backward, a block's position scores also get their gradients.
    full = rows * (_parakeet_block(*block, "none", e) + 2 * cfg.enc_heads * rows * e)
    return saved, conv, 2 * first * e, full


ENCODER_TERMS = {
    OWN_ENCODER: _own_encoder_terms,
    "whisper": _whisper_encoder_terms,
    "parakeet": _parakeet_encoder_terms,
}


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
    e, tp, cp = layout.element_bytes, layout.tp, layout.cp
    # The rules of the pretrained encoders' blocks and of MoE FFNs have no selective_op of
    # their own: priced as selective, which keeps more (an upper bound). The own encoder's
    # blocks are the LLM's.
    ac = "selective" if layout.ac == SELECTIVE_OP else layout.ac
    encoder_ac = layout.ac if cfg.encoder == OWN_ENCODER else ac
    b = batch.sequences
    d, vocab = cfg.d_model, cfg.vocab_size
    encoder = conv = enc_block_full = conv_grads = 0.0
    if has_encoder:
        saved, conv, conv_grads, enc_block_full = (
            b * term for term in ENCODER_TERMS[cfg.encoder](cfg, batch.frames, encoder_ac, e)
        )
        audio = audio_positions(cfg, batch.frames)
        if cfg.projector_stride > 1:  # the stacked copy of the encoder's output
            saved += b * encoder_frames(cfg, batch.frames) * cfg.enc_dim * e
        inputs = b * (audio + batch.tokens) * d * e  # kept by the gathers building the sequence
        encoder = saved + b * audio * 2 * d * e + inputs

    positions = batch.decoder_positions(cfg, sequence_multiple(tp, cp))
    local = positions / cp
    kv = cfg.n_kv_heads * llm_head_dim(cfg)
    f = 0 if cfg.n_experts else cfg.ffn_hidden
    context = cp > 1
    per_position = block_bytes(d, kv, f, cfg.n_heads, layout.ac, tp, e, context)
    per_position_full = block_bytes(d, kv, f, cfg.n_heads, "none", tp, e, context)
    if cfg.n_experts:
        per_position += moe_ffn_bytes(cfg, ac, e) / tp
        per_position_full += moe_ffn_bytes(cfg, "none", e) / tp
    whole_kv = positions * 2 * kv / tp * e if context else 0.0
    llm_block = b * (local * per_position + (2 if ac == "none" else 1) * whole_kv)
    llm_block_full = b * (local * per_position_full + 2 * whole_kv)
    ffn = cfg.top_k * cfg.moe_hidden if cfg.n_experts else cfg.ffn_hidden
    head = loss_backward = 0.0
    if has_head and not layout.loss_chunk:  # the full logits, their fp32 cast kept
        head = b * local * ((2 * d / tp + d) * e + vocab * FP32)
        kept = b * local * vocab * e if layout.pp > 1 else 0.0  # the stage's output
        loss_backward = kept + 2 * b * local * vocab * FP32
    elif has_head:
        gathered = b * local  # the positions whose hidden states the loss takes whole
        head = gathered * ((2 * d / tp + d) * e + FP32)
        rows = math.ceil(vocab / tp)
        chunk_bytes = min(layout.loss_chunk, gathered) * rows * (FP32 + (e if e != FP32 else 0))
        loss_backward = chunk_bytes + gathered * d * e + rows * d * (FP32 + e)
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
