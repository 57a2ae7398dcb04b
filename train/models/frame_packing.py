"""The encoder's segments run as one packed sequence: no frame of length padding is convolved,
projected or fed through an MLP.

A batch's segments come padded to the longest (``data.buckets`` keeps lengths close, but 6-17%
of the frames stay padding, docs/performance.md). Packed, each segment's feature frames sit one
after another in a single sequence, each starting at a multiple of the encoder's subsampling
``s`` and followed by at least ``s`` zero frames: every stride-2 convolution then reads, at a
segment's edges, the zeros it reads there padded, so each real frame's output is the padded
encoder's. The convolutions' output is gathered to the real frames alone (N of them, in segment
order) for the blocks; attention, the only place where frames of one segment meet, puts each
segment's frames back in its own row (``packed_attention``). Position tables are indexed by
each frame's position within its segment.

The plan (``FramePacking``) is made on the host from the batch's CPU lengths, as
``train.models.packing.audio_rows`` is, so that the packed shapes need no read from the device.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from train.models.batch import tensor_to_device
from train.models.packing import audio_rows
from train.models.shape import SALMConfig, encoder_frames, subsampled_lens

CPU = torch.device("cpu")  # where plans are made (explicit: a caller may set another default)
MIN_FEATURE_FRAMES = 16  # what the encoder always gets: a batch without audio encodes zeros


@dataclass(frozen=True)
class FramePacking:
    """Where the encoded segments' frames sit in the packed sequence (the host's plan)."""

    feature_row: torch.Tensor  # (F,) the real feature frames' rows
    feature_at: torch.Tensor  # (F,) and their frames in the row
    feature_dst: torch.Tensor  # (F,) their positions in the packed features
    # Per stride-2 convolution k = 0, 1, ..: its input's (L / 2**k,) frames inside a segment.
    level_masks: tuple[torch.Tensor, ...]
    frame_src: torch.Tensor  # (N,) the encoder frames' positions in the last level
    frame_pos: torch.Tensor  # (N,) each frame's position within its segment
    slots: torch.Tensor  # (R, T') each padded frame's index among the N, -1 on padding

    def to(self, device: torch.device) -> FramePacking:
        def moved(value):
            if isinstance(value, tuple):
                return tuple(tensor_to_device(v, device) for v in value)
            return tensor_to_device(value, device)

        return FramePacking(**{f.name: moved(getattr(self, f.name)) for f in fields(self)})

    def pack_features(self, features: torch.Tensor) -> torch.Tensor:
        """(R, T, bins) padded features -> (L, bins): each segment at its offset, zeros between."""
        flat = features[self.feature_row, self.feature_at]
        length = self.level_masks[0].shape[0]
        return flat.new_zeros(length, features.shape[2]).index_copy(0, self.feature_dst, flat)

    def frames(self, x: torch.Tensor) -> torch.Tensor:
        """The N encoder frames of the last level's packed output (..., L', d) -> (..., N, d)."""
        return x.index_select(-2, self.frame_src)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """Packed frames (1, N, d) -> (R, T', d), zeros past each segment's length."""
        rows, length = self.slots.shape
        return padded_rows(x[0], self.slots).reshape(rows, length, -1)


def padded_rows(packed: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """(N, ...) packed frames -> (R x T', ...): each slot's frame, zeros on padding slots."""
    flat = slots.flatten()
    valid = (flat >= 0).reshape(-1, *([1] * (packed.dim() - 1)))
    return packed.index_select(0, flat.clamp(min=0)) * valid


def packed_order(slots: torch.Tensor, frames: int) -> torch.Tensor:
    """The (N,) flat (R x T') positions of the packed frames, in packed order: the valid slots,
    row by row (a stable sort of their padding flags puts them first, in order)."""
    padding = (slots.flatten() < 0).to(torch.int8)
    return torch.argsort(padding, stable=True)[:frames]


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Bidirectional attention of packed frames q, k, v (N, heads, head_dim) within their
    segments: each segment's frames in a row of their own (R, heads, T', head_dim), its
    padding masked, through SDPA's kernels; the output packed again (N, heads, head_dim)."""
    rows, length = slots.shape
    heads = [padded_rows(t, slots).unflatten(0, (rows, length)).transpose(1, 2) for t in (q, k, v)]
    mask = (slots >= 0)[:, None, None, :]
    y = F.scaled_dot_product_attention(
        *heads, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=True
    )
    return y.transpose(1, 2).flatten(0, 1).index_select(0, packed_order(slots, q.shape[0]))


def frame_packing(cfg: SALMConfig, lens: torch.Tensor) -> FramePacking:
    """The plan for segments of ``lens`` (R,) feature frames (CPU). A batch without any audio
    packs one segment of ``MIN_FEATURE_FRAMES`` zeros instead, so the encoder still runs and
    every rank's sharded encoder joins the same collectives."""
    stride = cfg.enc_subsampling
    halvings = stride.bit_length() - 1
    lens = lens.to(torch.long).cpu()
    encoded = lens.clone()
    if not bool((lens > 0).any()):
        encoded[0] = MIN_FEATURE_FRAMES
    spans = (encoded + stride - 1) // stride * stride + stride  # a segment, then >= s zeros
    offsets = torch.cumsum(spans, 0) - spans
    length = int(spans.sum())
    row_ids = torch.arange(len(lens), device=CPU)
    feature_row = row_ids.repeat_interleave(lens)
    feature_at = within(lens)
    masks = []
    for level in range(halvings):  # the last level is gathered (frame_src), not masked
        level_lens = subsampled_lens(encoded, level)
        at = (offsets // 2**level).repeat_interleave(level_lens) + within(level_lens)
        masks.append(
            torch.zeros(length // 2**level, dtype=torch.bool, device=CPU).index_fill(0, at, True)
        )
    out_lens = encoder_frames(cfg, encoded)
    frame_pos = within(out_lens)
    frame_row = row_ids.repeat_interleave(out_lens)
    longest = int(out_lens.max())
    slots = torch.full((len(lens), longest), -1, dtype=torch.long, device=CPU)
    slots[frame_row, frame_pos] = torch.arange(len(frame_pos), device=CPU)
    return FramePacking(
        feature_row=feature_row,
        feature_at=feature_at,
        feature_dst=offsets.repeat_interleave(lens) + feature_at,
        level_masks=tuple(masks),
        frame_src=(offsets // stride).repeat_interleave(out_lens) + frame_pos,
        frame_pos=frame_pos,
        slots=slots,
    )


def within(lens: torch.Tensor) -> torch.Tensor:
    """0 .. len - 1 for each length in turn: (sum(lens),)."""
    starts = torch.cumsum(lens, 0) - lens
    return torch.arange(int(lens.sum()), device=CPU) - starts.repeat_interleave(lens)


@dataclass(frozen=True)
class EncoderPlan:
    """What the host reads of a batch's audio lengths before the step: the segments that hold
    audio (``audio_rows``; None: all) and, for an encoder that runs packed, how it packs them."""

    rows: torch.Tensor | None
    packing: FramePacking | None

    def to(self, device: torch.device) -> EncoderPlan:
        rows = None if self.rows is None else tensor_to_device(self.rows, device)
        return EncoderPlan(rows, None if self.packing is None else self.packing.to(device))


def encoder_plan(
    cfg: SALMConfig, encoder: torch.nn.Module | None, feature_lens: torch.Tensor
) -> EncoderPlan:
    """The plan of a batch's (B, K) or (B,) CPU segment lengths for ``encoder`` (packed
    where it ``packs_frames``)."""
    rows = audio_rows(feature_lens)
    if not getattr(encoder, "packs_frames", False):
        return EncoderPlan(rows, None)
    lens = feature_lens.flatten()
    if rows is not None:
        lens = lens.index_select(0, rows)
    return EncoderPlan(rows, frame_packing(cfg, lens))


def padding_share(cfg: SALMConfig, feature_lens: torch.Tensor) -> float:
    """The share of the padded encoder's output frames (segments with audio x the longest) that
    are padding: what packing saves of the blocks' work."""
    lens = feature_lens.flatten()
    lens = lens[lens > 0]
    if not len(lens):
        return 0.0
    out = encoder_frames(cfg, lens)
    return 1.0 - float(out.sum()) / (len(out) * int(out.max()))
