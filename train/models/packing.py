"""Packing a batch into the decoder's sequences: where each example's audio segments and text
tokens sit, the labels, and the splice of audio frames and text embeddings.

Each example becomes one sequence: its prompt tokens (none for the byte tokenizer), each audio
segment where its turn is, its other tokens, then right padding to a length the layout's
sequence sharding divides (``packed_length``). Pure tensor arithmetic on the batch's lengths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from train.models.batch import Batch
from train.models.shape import SALMConfig, audio_positions

IGNORE_INDEX = -100  # the label of a position that is no target


@dataclass(frozen=True)
class SequenceLayout:
    """Where each example's audio and text sit in its packed decoder sequence."""

    is_audio: torch.Tensor  # (B, S) audio positions
    is_text: torch.Tensor  # (B, S) text positions (the prompt before the audio, the rest after)
    text_index: torch.Tensor  # (B, S) index into the tokens at text positions (clamped elsewhere)
    audio_segment: torch.Tensor  # (B, S) which of the example's audio segments (0 elsewhere)
    audio_frame: torch.Tensor  # (B, S) the frame of that segment at audio positions (0 elsewhere)
    labels: torch.Tensor  # (B, S) the next token where it is an answer token, else ignored

    @property
    def token_mask(self) -> torch.Tensor:
        """Real positions (audio or text); the rest is padding."""
        return self.is_audio | self.is_text


def packed_length(longest: int, multiple: int) -> int:
    """The decoder sequence length of a batch whose longest example has ``longest`` positions
    (audio frames after subsampling plus text tokens): rounded up to ``multiple``."""
    return max(1, math.ceil(longest / multiple)) * multiple


def longest_example(audio_lens: torch.Tensor, token_lens: torch.Tensor) -> int:
    """The decoder positions of a batch's longest example (a host read of the lengths)."""
    return int((audio_lens + token_lens).max())


def segments(
    features: torch.Tensor, feature_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Features (B, K, T, bins) and lengths (B, K) of each example's K audio segments (an
    example without K has zero-length ones); a batch of one segment each may come as (B, T,
    bins) and (B,)."""
    if features.dim() == 3:
        return features[:, None], feature_lens[:, None]
    return features, feature_lens


def audio_rows(feature_lens: torch.Tensor) -> torch.Tensor | None:
    """The flat (B x K) indices of a batch's segments that hold audio, from its CPU lengths, so
    that the encoder runs on those alone (an example with fewer segments than the batch's most
    is padded with empty ones: 20 of conversations' 38% of encoder padding, docs/performance.md).
    At least one row (the first), as the encoder runs on every batch; None where every segment
    holds audio."""
    held = feature_lens.flatten() > 0  # (B, K), or (B,) for one segment each
    if bool(held.all()):
        return None
    rows = held.nonzero().flatten()
    return rows if len(rows) else feature_lens.new_zeros(1, dtype=torch.long)


def example_positions(cfg: SALMConfig, feature_lens: torch.Tensor) -> torch.Tensor:
    """Each example's audio positions in the decoder, all its segments together: (B,)."""
    positions = audio_positions(cfg, feature_lens)
    return positions.sum(-1) if positions.dim() == 2 else positions


def sequence_layout(
    audio_lens: torch.Tensor,
    tokens: torch.Tensor,
    token_lens: torch.Tensor,
    seq_len: int,
    audio_at: torch.Tensor,
    target_mask: torch.Tensor,
    offsets: torch.Tensor | None = None,
) -> SequenceLayout:
    """One sequence per example: its tokens with each audio segment k (``audio_lens[:, k]``
    positions) before token ``audio_at[:, k]`` (in order), then padding; labels on the tokens
    ``target_mask`` (B, L) marks, each at the position of the token before it (never a
    segment's: ``Encoded``). ``offsets`` (B,): where each sequence starts (decoding's left
    padding); before it is padding."""
    if audio_lens.dim() == 1:  # one segment each
        audio_lens = audio_lens[:, None]
    audio_at = audio_at.reshape(audio_lens.shape)
    pos = torch.arange(seq_len, device=tokens.device)[None, :]
    if offsets is not None:
        pos = pos - offsets[:, None]
    starts = audio_at + torch.cumsum(audio_lens, dim=1) - audio_lens  # (B, K)
    into = pos[..., None] - starts[:, None, :]  # (B, S, K): position relative to each segment
    inside = (into >= 0) & (into < audio_lens[:, None, :])
    is_audio = inside.any(-1)
    segment_ids = torch.arange(audio_lens.shape[1], device=tokens.device)
    audio_segment = (inside * segment_ids).sum(-1)
    audio_frame = (inside * into).sum(-1)
    audio_before = torch.minimum(into.clamp(min=0), audio_lens[:, None, :]).sum(-1)
    text_pos = pos - audio_before
    is_text = ~is_audio & (pos >= 0) & (text_pos < token_lens[:, None])
    text_index = text_pos.clamp(0, tokens.shape[1] - 1)
    next_index = text_pos + 1
    next_clamped = next_index.clamp(0, tokens.shape[1] - 1)
    is_target = (
        is_text
        & (next_index < token_lens[:, None])
        & target_mask.to(torch.bool).gather(1, next_clamped)
    )
    next_tokens = tokens.gather(1, next_clamped)
    labels = torch.where(is_target, next_tokens, IGNORE_INDEX)
    return SequenceLayout(is_audio, is_text, text_index, audio_segment, audio_frame, labels)


def batch_layout(batch: Batch, audio_lens: torch.Tensor, seq_len: int) -> SequenceLayout:
    """The sequence layout of ``batch`` with ``audio_lens`` (B, K) positions per segment."""
    audio_at, target_mask = batch.prompt()
    return sequence_layout(
        audio_lens, batch.tokens, batch.token_lens, seq_len, audio_at, target_mask
    )


def splice(audio: torch.Tensor, text: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    """Sequences (B, S, d) of audio frames (B, K, A, d) and text embeddings (B, L, d): each
    position takes its segment's frame where ``layout`` has audio, its token's embedding where
    it has text, zeros elsewhere."""
    B, K, A, d = audio.shape
    frames = audio.reshape(B, K * A, d)
    frame_index = layout.audio_segment * A + layout.audio_frame.clamp(0, A - 1)
    from_audio = frames.gather(1, frame_index[..., None].expand(-1, -1, d))
    from_text = text.gather(1, layout.text_index[..., None].expand(-1, -1, d))
    text_part = from_text * layout.is_text[..., None]
    return torch.where(layout.is_audio[..., None], from_audio, text_part)
