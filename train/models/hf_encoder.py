"""A pretrained Hugging Face audio encoder (Whisper, Parakeet) as the SALM's encoder.

transformers' own layers, built from the encoder directory's ``config.json`` and kept under their
own names (the model's ``encoder.<transformers' name>``: loading, export and ``model.freeze``
map by that prefix), run with the interface of the own ``AudioEncoder``: features (B, T, bins),
zero-padded, and their lengths in; frames (B, T', enc_dim) and their lengths
(``train.models.shape.encoder_frames``) out. Every utterance runs at its actual length, and the
padding of a batch changes no real frame's output:

- Whisper: transformers' ``WhisperEncoder`` takes exactly 30 s (3000 frames). Here its conv1 and
  conv2 run on the batch's frames (padded frames zeroed before each, so a frame near the end
  sees what it sees alone), its position table is sliced to the frames there are, its blocks
  mask the padded keys, then its final layer norm: on a 30-s input, transformers' computation.
  Longer inputs are refused (the table has 1500 rows).
- Parakeet: transformers' own masking (its subsampling zeroes padded frames after each
  convolution, attention and the convolution module mask them), as ``ParakeetEncoder`` runs a
  batch with an attention mask.

Where training departs from transformers': no layer drop (every rank must run every block: FSDP
gathers a block's weights collectively), and Parakeet's batch norms normalize with their
pretrained running statistics in training too (batch statistics would depend on the padding
and on how a batch is split over ranks); their scale and shift still train. Frozen tensors are
parameters that never train (Whisper's sinusoidal position table, as in transformers; those
statistics), so loading, checkpoints and export treat them as every other parameter
(``train.models.inventory`` marks them untrainable, ``train.parallel.layout.frozen_of`` freezes
them). Parakeet's relative position table is computed at each forward (transformers keeps its
frequencies in a buffer that materializing from the meta device would destroy).

transformers is imported only where such an encoder is built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from train.models.frame_packing import FramePacking, packed_attention
from train.models.layers import inverse_frequencies, length_mask
from train.models.shape import SALMConfig, encoder_frames

PARAKEET_POSITION_BASE = 10000.0  # transformers' ParakeetEncoderRelPositionalEncoding
FRAME_ATTENTION = "salm_frames"  # the attention implementation Whisper's blocks run here


def transformers_class(family: str) -> type[nn.Module]:
    """transformers' class of ``family``'s encoder alone (what ``from_pretrained`` of an
    export's encoder directory takes). A slow import: only where a pretrained encoder is used."""
    if family == "whisper":
        from transformers.models.whisper.modeling_whisper import WhisperEncoder

        return WhisperEncoder
    from transformers import ParakeetEncoder

    return ParakeetEncoder


def pretrained_encoder(cfg: SALMConfig) -> nn.Module:
    """The encoder of ``cfg.encoder_dir``, with random weights (on the caller's device, the meta
    device when the trainer builds): the weights are loaded later, shard by shard
    (``train.models.hf_weights.load_encoder_weights``)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(cfg.encoder_dir)
    config = getattr(config, "encoder_config", config)  # a ParakeetForCTC's
    encoder = transformers_class(cfg.encoder)(config)
    if cfg.encoder == "whisper":
        from transformers import AttentionInterface

        AttentionInterface.register(FRAME_ATTENTION, frame_attention)
        encoder.set_attn_implementation(FRAME_ATTENTION)
        return WhisperSpeechEncoder(cfg, encoder)
    return ParakeetSpeechEncoder(cfg, encoder)


def frame_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
    """transformers' attention interface for Whisper's blocks here: SDPA's, as transformers
    runs it, on padded rows; on packed frames (their (R, 1, 1, T') slots, long, for a mask:
    ``WhisperSpeechEncoder.packed``) attention within each segment."""
    if attention_mask is None or attention_mask.dtype != torch.long:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kw
        )
    heads = (t[0].transpose(0, 1) for t in (query, key, value))  # (N, heads, head_dim)
    dropout_p = dropout if module.training else 0.0
    return packed_attention(*heads, attention_mask[:, 0, 0], scaling, dropout_p)[None], None


def key_mask(lens: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B, 1, 1, T) additive attention mask of ``like`` (B, T, d): zero on each example's real
    frames, the dtype's minimum on its padding (finite, so a row of padding stays finite)."""
    valid = length_mask(lens, like.shape[1])[:, None, None, :]
    return torch.zeros_like(valid, dtype=like.dtype).masked_fill(
        ~valid, torch.finfo(like.dtype).min
    )


class WhisperSpeechEncoder(nn.Module):
    """Whisper's encoder (conv1, conv2, embed_positions, layers, layer_norm) on actual lengths."""

    # A block's x (B, T, d) and key mask (B, 1, 1, T), or packed: (1, N, d) and slots (R, 1, 1, T').
    block_dims = ((0, 1), (0, 3))
    packs_frames = True  # train.models.frame_packing

    def __init__(self, cfg: SALMConfig, encoder: nn.Module) -> None:
        super().__init__()
        self.cfg = cfg
        self.conv1, self.conv2 = encoder.conv1, encoder.conv2
        self.embed_positions = encoder.embed_positions  # frozen, as transformers keeps it
        self.layers = encoder.layers
        self.layer_norm = encoder.layer_norm
        self.dropout = encoder.dropout
        self.max_frames = cfg.enc_positions * cfg.enc_subsampling

    def forward(
        self, features, feature_lens, packing: FramePacking | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``packing``: run the segments as one packed sequence, the same output."""
        frames = features.shape[1]
        if frames > self.max_frames:
            raise ValueError(
                f"a Whisper encoder takes at most {self.max_frames} feature frames (30 s); "
                f"this batch has {frames}: keep utterances at most 30 s long"
            )
        if packing is not None:
            return self.packed(features, feature_lens, packing)
        valid = length_mask(feature_lens, frames)[:, None, :]
        x = F.gelu(self.conv1(features.transpose(1, 2) * valid)) * valid
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        x = x + self.embed_positions.weight[: x.shape[1]]
        x = F.dropout(x, p=self.dropout, training=self.training)
        lens = encoder_frames(self.cfg, feature_lens)
        mask = key_mask(lens, x)
        for layer in self.layers:
            x = layer(x, mask)
        return self.layer_norm(x), lens

    def packed(self, features, feature_lens, packing: FramePacking):
        valid = packing.level_masks[0]
        x = F.gelu(self.conv1(packing.pack_features(features).T[None])) * valid
        x = packing.frames(F.gelu(self.conv2(x)).transpose(1, 2))  # (1, N, d)
        x = x + self.embed_positions.weight[packing.frame_pos]
        x = F.dropout(x, p=self.dropout, training=self.training)
        slots = packing.slots[:, None, None, :]
        for layer in self.layers:
            x = layer(x, slots)
        return packing.unpack(self.layer_norm(x)), encoder_frames(self.cfg, feature_lens)


class FrozenStatisticsNorm(nn.Module):
    """A batch norm over channels (B, C, T) that always normalizes with its pretrained running
    statistics, held as frozen parameters; its scale and shift train. Names as transformers'
    ``BatchNorm1d`` (``weight``, ``bias``, ``running_mean``, ``running_var``)."""

    def __init__(self, norm: nn.BatchNorm1d) -> None:
        super().__init__()
        self.weight, self.bias = norm.weight, norm.bias
        self.running_mean = nn.Parameter(norm.running_mean, requires_grad=False)
        self.running_var = nn.Parameter(norm.running_var, requires_grad=False)
        self.eps = norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean, var = self.running_mean, self.running_var
        return F.batch_norm(x, mean, var, self.weight, self.bias, training=False, eps=self.eps)


def relative_positions(length: int, dim: int, like: torch.Tensor) -> torch.Tensor:
    """Parakeet's (B, 2 length - 1, dim) table of relative distances length - 1 .. -(length - 1),
    sine and cosine interleaved, in ``like``'s dtype (transformers'
    ParakeetEncoderRelPositionalEncoding, its frequencies computed here)."""
    distances = torch.arange(length - 1, -length, -1, device=like.device).float()
    angles = torch.outer(distances, inverse_frequencies(dim, PARAKEET_POSITION_BASE, like.device))
    table = torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)
    return table.to(like.dtype).expand(like.shape[0], -1, -1).contiguous()


class ParakeetSpeechEncoder(nn.Module):
    """Parakeet's FastConformer encoder (subsampling, layers) with its own masking."""

    # A block's x (B, T, d), its (B, 1, T, T) mask of real query-key pairs, and the relative
    # position table (B, 2T - 1, d).
    block_dims = ((0, 1), (0, 2, 3), (0, 1))

    def __init__(self, cfg: SALMConfig, encoder: nn.Module) -> None:
        super().__init__()
        self.cfg = cfg
        self.subsampling = encoder.subsampling
        self.layers = encoder.layers
        for layer in self.layers:
            layer.conv.norm = FrozenStatisticsNorm(layer.conv.norm)
        self.input_scale = encoder.input_scale
        self.dropout, self.dropout_positions = encoder.dropout, encoder.dropout_positions

    def forward(self, features, feature_lens) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.subsampling(features, length_mask(feature_lens, features.shape[1]))
        x = x * self.input_scale
        positions = relative_positions(x.shape[1], self.cfg.enc_dim, x)
        x = F.dropout(x, p=self.dropout, training=self.training)
        positions = F.dropout(positions, p=self.dropout_positions, training=self.training)
        lens = encoder_frames(self.cfg, feature_lens)
        # The first frame is always valid, so an example without frames (text only) stays
        # finite: a row of attention with no key would be NaN, and so would its gradients.
        valid = length_mask(lens, x.shape[1]) | (torch.arange(x.shape[1], device=x.device) == 0)
        pairs = (valid[:, :, None] & valid[:, None, :])[:, None]
        for layer in self.layers:
            x = layer(x, pairs, positions)
        return x, lens
