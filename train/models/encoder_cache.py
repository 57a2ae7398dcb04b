"""A frozen audio encoder's outputs kept per utterance, so that a job encodes each one once.

A frozen encoder gives the same frames for the same features at every step, and a pretrained
one can cost most of a step (Whisper tiny.en's on CPU: ~0.45 of 0.57 s, docs/performance.md).
With ``train.encoder_cache_mb`` the trainer encodes an utterance it has not seen before alone,
keeps its frames on the device under the digest of its features, and splices kept frames into
every later batch that holds it:

- **Bitwise across jobs.** An utterance's frames depend on its own features only (it is encoded
  alone, never padded beside batch-mates), so a resumed job, whose cache starts empty, computes
  exactly the frames the uninterrupted job had kept, and continues bitwise.
- **No collectives.** The frames come from a plain replica of the encoder that holds its full
  weights (``train.models.build.encoder_replica``, gathered once), not from the sharded
  encoder: ranks that meet different new utterances in a step run no FSDP all-gather that
  another rank would not.
- **As at inference.** The replica runs in eval mode (no dropout), as NeMo's ``freeze()`` leaves
  a frozen module, in the dtype the sharded encoder computes in.
- **Bounded.** Past ``max_bytes`` nothing more is kept; the utterances not kept are encoded
  again each time they come (the same frames: only the time differs).

The key is the features' content, not the cut id: two sources may reuse an id, and features
computed differently (another extractor, a perturbation) must not meet another's frames.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from train.models.shape import SALMConfig, encoder_frames

MIB = 2**20


class EncoderKeys(NamedTuple):
    """The cache's key for each example of a batch, and its feature frames: read from the CPU
    batch before it moves to the device (nothing is read back from it). A NamedTuple, so that
    FSDP's input casting passes it through as it is."""

    digests: tuple[bytes, ...]
    lengths: tuple[int, ...]


def encoder_keys(features: torch.Tensor, feature_lens: torch.Tensor) -> EncoderKeys:
    """Keys of a CPU batch's audio segments, in the order the encoder sees them (each example's
    in turn, ``train.models.salm.encode_audio``): a digest of each one's real frames."""
    features, feature_lens = features.flatten(0, -3), feature_lens.flatten()
    lengths = tuple(int(n) for n in feature_lens.tolist())
    digests = []
    for example, length in zip(features, lengths, strict=True):
        real = example[:length].contiguous().numpy()
        digest = hashlib.blake2b(digest_size=16)
        digest.update(str(real.shape).encode())
        digest.update(real)
        digests.append(digest.digest())
    return EncoderKeys(tuple(digests), lengths)


class EncoderCache:
    """Frames of a frozen encoder by the digest of their features, up to ``max_bytes``."""

    def __init__(self, replica: nn.Module, cfg: SALMConfig, max_bytes: int) -> None:
        self.replica = replica
        self.cfg = cfg
        self.dtype = next(replica.parameters()).dtype
        self.max_bytes = max_bytes
        self.frames: dict[bytes, torch.Tensor] = {}
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    @torch.no_grad()
    def encode(
        self, keys: EncoderKeys, features: torch.Tensor, feature_lens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoder's (B, T', d) frames of a batch, zero past each example's length, and
        their lengths: kept frames where the cache has them, the others encoded one by one.
        T' is what the encoder gives the batch's T feature frames, as if it had run: a batch
        of text alone still has frames (zeros), so the projector after it stays in the step's
        graph and gets a gradient on every rank; a rank without one would skip its FSDP
        reduce-scatter and mismatch the others' collectives."""
        outputs = []
        for index, (digest, length) in enumerate(zip(keys.digests, keys.lengths, strict=True)):
            frames = self.frames.get(digest)
            if length == 0:  # no audio (a text-only example): no frames
                frames = features.new_zeros((0, self.cfg.enc_dim), dtype=self.dtype)
            elif frames is None:
                self.misses += 1
                encoded, _ = self.replica(
                    features[index : index + 1, :length].to(self.dtype),
                    feature_lens[index : index + 1],
                )
                frames = encoded[0, : encoder_frames(self.cfg, length)].clone()
                self.keep(digest, frames)
            else:
                self.hits += 1
            outputs.append(frames)
        lens = encoder_frames(self.cfg, torch.tensor(keys.lengths, device=features.device))
        frames = pad_sequence(outputs, batch_first=True)
        width = encoder_frames(self.cfg, features.shape[1])
        return F.pad(frames, (0, 0, 0, width - frames.shape[1])), lens

    def keep(self, digest: bytes, frames: torch.Tensor) -> None:
        size = frames.numel() * frames.element_size()
        if self.bytes + size <= self.max_bytes:
            self.frames[digest] = frames
            self.bytes += size

    def describe(self) -> str:
        """One line: what the cache holds and how often it answered."""
        looked_up = self.hits + self.misses
        rate = 100 * self.hits / looked_up if looked_up else 0.0
        return (
            f"encoder cache: {len(self.frames)} utterances in {self.bytes / MIB:.1f} of "
            f"{self.max_bytes / MIB:.0f} MiB; {rate:.1f}% of {looked_up} lookups answered"
        )
