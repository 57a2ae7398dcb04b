"""What one example costs the training step: its FLOPs at a model's shape, from its cut alone
(nothing loaded), for dealing examples to ranks by work (``train.data.balance``) and for
measuring how evenly they are dealt (``bench.bench_batch_balance``)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from lhotse.cut import Cut
from lhotse.utils import compute_num_frames

from train.data.balance import CostOf
from train.data.conversation_cuts import audio_segments
from train.data.loader import TextCodec, encoded
from train.flops import sequence_flops
from train.models.shape import SALMConfig


def segment_frames(cut: Cut, hop_s: float, sampling_rate: int) -> list[int]:
    """The feature frames (``hop_s`` apart) of each of the cut's audio segments."""
    return [
        compute_num_frames(segment.duration, hop_s, sampling_rate)
        for segment in audio_segments(cut)
    ]


def example_frames(cuts: Sequence[Cut], hop_s: float, sampling_rate: int) -> torch.Tensor:
    """(examples, most segments) float64 feature frames of each cut's segments, 0 where none."""
    segments = [segment_frames(cut, hop_s, sampling_rate) for cut in cuts]
    frames = torch.zeros(
        (len(cuts), max(1, *(len(found) for found in segments))), dtype=torch.float64
    )
    for row, found in enumerate(segments):
        frames[row, : len(found)] = torch.tensor(found, dtype=torch.float64)
    return frames


def example_tokens(text: TextCodec, cut: Cut) -> int:
    """The cut's tokens as its batch renders them; 0 for one the codec refuses, which its
    batch's worker leaves out and reports (``train.data.loader.SpeechDataset``), not this."""
    try:
        return len(encoded(text, cut).tokens)
    except ValueError:
        return 0


def example_flops(
    cfg: SALMConfig, text: TextCodec, hop_s: float, sampling_rate: int, cuts: Sequence[Cut]
) -> list[float]:
    """Each cut's training FLOPs at ``cfg``'s shape (``train.flops.sequence_flops``: encoder,
    projector and decoder), from its segments' feature frames and its tokens as the batch
    renders them."""
    frames = example_frames(cuts, hop_s, sampling_rate)
    tokens = torch.tensor([example_tokens(text, cut) for cut in cuts], dtype=torch.float64)
    return sequence_flops(cfg, frames, tokens).tolist()


def flops_cost(cfg: SALMConfig, text: TextCodec, hop_s: float, sampling_rate: int) -> CostOf:
    """``example_flops`` bound to a model's shape, its text codec and its features' frames."""
    return functools.partial(example_flops, cfg, text, hop_s, sampling_rate)
