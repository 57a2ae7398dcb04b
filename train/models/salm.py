"""A small speech LLM in the spirit of NeMo's SALM, readable in one file.

fbank features (B, T, 80) -> audio encoder (conv subsampling x4 + transformer blocks, or a
pretrained Whisper or Parakeet encoder on its own features: ``train.models.hf_encoder``) ->
projector (``projector_stride`` frames stacked per position) -> decoder-only LLM (RMSNorm, RoPE,
SwiGLU or MoE, GQA). Each example becomes one sequence: its prompt tokens, its audio
embeddings, its other tokens, then right padding (``train.models.packing``). The loss is
next-token prediction on the answer only (``train.models.loss``). Every output on a real
position ignores padding, so a batch split across ranks computes exactly what the whole batch
computes in one process. The text side (the byte tokenizer, a pretrained LLM's chat template)
is ``train.data.text``'s and ``train.data.prompt``'s: the model sees token ids only.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from train.models.batch import Batch
from train.models.context import (
    context_attention,
    gather_sequence,
    local_positions,
    shard_sequence,
)
from train.models.encoder_cache import EncoderCache, EncoderKeys
from train.models.frame_packing import (
    MIN_FEATURE_FRAMES,
    EncoderPlan,
    FramePacking,
    packed_attention,
)
from train.models.head_loss import head_loss
from train.models.hf_encoder import pretrained_encoder
from train.models.layers import apply_rope, length_mask, rope_tables
from train.models.lora import add_adapters
from train.models.loss import SALMOutput, aux_weight
from train.models.moe import MoE
from train.models.packing import (
    IGNORE_INDEX,
    SequenceLayout,
    batch_layout,
    example_positions,
    longest_example,
    packed_length,
    segments,
    splice,
)
from train.models.shape import (
    OWN_ENCODER,
    SALMConfig,
    llm_head_dim,
    stacked,
    subsampled_lens,
)
from train.parallel.dims import BASE_SEQ_MULTIPLE, DEFAULT_LOSS_CHUNK

if TYPE_CHECKING:
    from train.models.kv_cache import KVCache


class Attention(nn.Module):
    """Grouped-query attention; heads are inferred from shapes, so TP-sharded heads just work.

    Under context parallelism (``cp_mesh`` set) ``x`` holds this rank's chunks of the sequence:
    keys and values are gathered from the whole CP group and each chunk of queries attends
    causally to the keys up to its end (`context_attention`).
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        causal: bool,
        head_dim: int = 0,
        bias: bool = False,
        qk_norm_eps: float | None = None,
    ) -> None:
        """``head_dim`` 0: ``dim // n_heads``; ``bias``: q/k/v biases (Qwen2); ``qk_norm_eps``:
        an RMSNorm over each head of q and k before RoPE (Qwen3)."""
        super().__init__()
        self.head_dim = head_dim or dim // n_heads
        self.causal = causal
        self.cp_mesh: DeviceMesh | None = None
        self.kv_cache: KVCache | None = None  # set while decoding (train/eval/decode.py)
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=qk_norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=qk_norm_eps)

    def forward(self, x, cos, sin, mask: torch.Tensor | None) -> torch.Tensor:
        """``mask``: (B, T) keys that may be attended (encoder); None for causal attention; for
        an encoder running packed frames (``x`` of one row), their slots (long: a
        ``FramePacking``'s), which keep each segment's frames to themselves."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim)
        k = self.wk(x).view(B, T, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        if self.kv_cache is not None:
            y = self.kv_cache.attend(q, k, v)
        elif mask is not None and mask.dtype == torch.long:
            y = packed_attention(q[0], k[0], v[0], mask)[None]
        elif self.cp_mesh is not None:
            k, v = gather_sequence(k, self.cp_mesh), gather_sequence(v, self.cp_mesh)
            cp, rank = self.cp_mesh.size(), self.cp_mesh.get_local_rank()
            heads = (t.transpose(1, 2) for t in (q, k, v))
            y = context_attention(*heads, cp, rank).transpose(1, 2)
        else:
            y = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                attn_mask=None if mask is None else mask[:, None, None, :],
                is_causal=self.causal,
                enable_gqa=True,
            ).transpose(1, 2)
        return self.wo(y.reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm transformer block; the FFN is dense or MoE. Returns (x, MoE aux loss)."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        causal: bool,
        norm_eps: float,
        ffn_hidden: int,
        moe: MoE | None = None,
        attention: Attention | None = None,
    ) -> None:
        """``attention``: the attention half when it is not plain (the LLM's, shaped by a
        pretrained family's options)."""
        super().__init__()
        self.attn_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.attn = attention or Attention(dim, n_heads, n_kv_heads, causal)
        self.ffn_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.moe = moe
        self.ffn = None if moe else FeedForward(dim, ffn_hidden)

    def forward(self, x, cos, sin, key_mask, token_mask) -> tuple[torch.Tensor, torch.Tensor]:
        x, h = self.mix(x, cos, sin, key_mask)
        if self.moe is None:
            return x + self.ffn(h), x.new_zeros((), dtype=torch.float32)
        out, aux = self.moe(h, token_mask)
        return x + out, aux

    def mix(self, x, cos, sin, key_mask) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention half with its residual, and the FFN's normalized input."""
        x = x + self.attn(self.attn_norm(x), cos, sin, key_mask)
        return x, self.ffn_norm(x)


# The dimensions of a Block's positional arguments that vary between batches (what compiling
# marks dynamic): x (batch, sequence), the RoPE tables (sequence), the key mask and the token
# mask (batch, sequence).
BLOCK_DIMS = ((0, 1), (0,), (0,), (0, 1), (0, 1))


class AudioEncoder(nn.Module):
    """Conv2d subsampling x4 over (time, mel), then bidirectional transformer blocks."""

    block_dims = BLOCK_DIMS
    packs_frames = True  # runs a FramePacking's one sequence (train.models.frame_packing)

    def __init__(self, cfg: SALMConfig) -> None:
        super().__init__()
        channels = cfg.enc_dim
        self.conv1 = nn.Conv2d(1, channels, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=2, padding=1)
        freq = subsampled_lens(cfg.n_mels, 2)
        self.conv_out = nn.Linear(channels * freq, cfg.enc_dim)
        self.layers = nn.ModuleList(
            Block(
                cfg.enc_dim, cfg.enc_heads, cfg.enc_heads, False, cfg.norm_eps, cfg.enc_ffn_hidden
            )
            for _ in range(cfg.enc_layers)
        )
        self.norm = nn.RMSNorm(cfg.enc_dim, eps=cfg.norm_eps)
        self.rope_theta = cfg.rope_theta
        self.head_dim = cfg.enc_dim // cfg.enc_heads

    def forward(
        self, features, feature_lens, packing: FramePacking | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, n_mels) -> (B, ceil(T/4), enc_dim) and lengths; padded frames are zeroed
        after each conv so a frame near the end never sees how much padding follows it.
        ``packing``: run the segments as one packed sequence, the same output."""
        if packing is not None:
            return self.packed(features, feature_lens, packing)
        x = features * length_mask(feature_lens, features.shape[1])[..., None]
        x = x.unsqueeze(1)
        lens = feature_lens
        for conv in (self.conv1, self.conv2):
            x = F.relu(conv(x))
            lens = subsampled_lens(lens)
            x = x * length_mask(lens, x.shape[2])[:, None, :, None]
        B, C, T, Fr = x.shape
        x = self.conv_out(x.permute(0, 2, 1, 3).reshape(B, T, C * Fr))
        # The first frame is always attendable, so an example with no frames (a pipeline's
        # padding example) stays finite; every real example has that frame anyway.
        mask = length_mask(lens, T) | (torch.arange(T, device=x.device) == 0)
        cos, sin = rope_tables(T, self.head_dim, self.rope_theta, x.device)
        for layer in self.layers:
            x, _ = layer(x, cos, sin, mask, None)
        return self.norm(x), lens

    def packed(self, features, feature_lens, packing: FramePacking):
        x = packing.pack_features(features)[None, None]  # (1, 1, L, n_mels)
        x = F.relu(self.conv1(x)) * packing.level_masks[1][None, None, :, None]
        x = F.relu(self.conv2(x))
        x = packing.frames(x.permute(0, 2, 1, 3).flatten(2))  # (1, N, C * F')
        x = self.conv_out(x)
        longest = packing.slots.shape[1]
        cos, sin = rope_tables(longest, self.head_dim, self.rope_theta, x.device)
        cos, sin = cos[packing.frame_pos], sin[packing.frame_pos]
        for layer in self.layers:
            x, _ = layer(x, cos, sin, packing.slots, None)
        return packing.unpack(self.norm(x)), subsampled_lens(feature_lens, 2)


def llm_attention(cfg: SALMConfig) -> Attention:
    """An LLM block's attention, with the options of the decoder's family."""
    return Attention(
        cfg.d_model,
        cfg.n_heads,
        cfg.n_kv_heads,
        True,
        head_dim=cfg.head_dim,
        bias=cfg.qkv_bias,
        qk_norm_eps=cfg.norm_eps if cfg.qk_norm else None,
    )


class Decoder(nn.Module):
    """The LLM: embeddings, causal blocks, final norm and output head.

    `forward` takes already-embedded inputs (audio then text) and runs the blocks it holds.
    Blocks sit in a ModuleDict keyed by their index, so a pipeline stage that keeps some of
    them (and drops the norm and head unless it is the last) names its parameters exactly as
    the whole model does.
    """

    def __init__(self, cfg: SALMConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleDict(
            {
                str(index): Block(
                    cfg.d_model,
                    cfg.n_heads,
                    cfg.n_kv_heads,
                    True,
                    cfg.norm_eps,
                    cfg.ffn_hidden,
                    MoE(cfg.d_model, cfg.moe_hidden, cfg.n_experts, cfg.top_k)
                    if cfg.n_experts
                    else None,
                    llm_attention(cfg),
                )
                for index in range(cfg.n_layers)
            }
        )
        self.norm: nn.RMSNorm | None = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head: nn.Linear | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.tied = cfg.tie_embeddings
        self.tie_head()
        self.rope_theta = cfg.rope_theta
        self.head_dim = llm_head_dim(cfg)
        self.cp_mesh: DeviceMesh | None = None  # set under CP: inputs are this rank's chunks
        if cfg.lora_rank:
            add_adapters(self, cfg)

    def tie_head(self) -> None:
        """Make a tied model's output head the embedding matrix (again): materializing from the
        meta device (``to_empty``) and TP's sharding each give every module a parameter of its
        own, so the builder re-ties after both."""
        if self.tied and self.lm_head is not None and self.embed is not None:
            self.lm_head.weight = self.embed.weight

    def enter(self, x: torch.Tensor, *per_position: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The decoder's input and per-position tensors as this rank holds them: whole, or under
        CP its chunks of the sequence (TP then shards ``x`` further as it enters ``forward``)."""
        if self.cp_mesh is None:
            return (x, *per_position)
        return tuple(shard_sequence(t, self.cp_mesh) for t in (x, *per_position))

    def forward(
        self, x, token_mask, positions: torch.Tensor | None = None, head: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` (B, S, d) (under CP this rank's chunks, under TP its sequence shard of those),
        ``token_mask`` (B, S) for the same positions as ``x`` before TP; ``positions`` (S,)
        the RoPE positions when they are not ``0 .. S - 1`` (decoding).

        Returns the logits (the blocks' output if this part has no head, or without ``head``:
        the training loss applies the norm and head itself, ``head_loss``) and the MoE balance
        losses of its blocks, summed over blocks and sequences.
        """
        if positions is None:
            cos, sin = self.rope(token_mask.shape[1], x.device)
        else:
            longest = int(positions.max()) + 1
            cos, sin = rope_tables(longest, self.head_dim, self.rope_theta, x.device)
            cos, sin = cos[positions], sin[positions]
        aux = x.new_zeros((), dtype=torch.float32)
        for layer in self.layers.values():
            x, layer_aux = layer(x, cos, sin, None, token_mask)
            aux = aux + layer_aux
        if self.lm_head is None or not head:
            return x, aux
        return self.lm_head(self.norm(x)), aux

    def head_loss(self, x: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
        """The summed next-token loss of the blocks' output ``x`` at the positions ``labels``
        marks, ``chunk`` positions' logits at a time (train/models/head_loss.py)."""
        return head_loss(self.norm(x), self.lm_head.weight, labels, chunk)

    def rope(self, local_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables at the global positions of this rank's ``local_len`` positions."""
        if self.cp_mesh is None:
            return rope_tables(local_len, self.head_dim, self.rope_theta, device)
        cp = self.cp_mesh.size()
        cos, sin = rope_tables(local_len * cp, self.head_dim, self.rope_theta, device)
        positions = local_positions(local_len * cp, cp, self.cp_mesh.get_local_rank(), device)
        return cos[positions], sin[positions]


class Projector(nn.Sequential):
    """Linear, GELU, Linear from the encoder's width to the LLM's, over groups of ``stride``
    consecutive encoder frames concatenated (an example's last group zero-padded): the LLM gets
    one audio position per group. At stride 1 it is the plain MLP over each frame."""

    def __init__(self, enc_dim: int, d_model: int, stride: int) -> None:
        super().__init__(
            nn.Linear(stride * enc_dim, d_model), nn.GELU(), nn.Linear(d_model, d_model)
        )
        self.stride = stride

    def forward(
        self, frames: torch.Tensor, lens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, enc_dim) frames and their lengths -> (B, ceil(T/stride), d_model) positions
        and theirs; frames past an example's length are zeroed first, so its last group holds
        its own frames and zeros whatever padding follows."""
        if self.stride > 1:
            B, T, C = frames.shape
            frames = frames * length_mask(lens, T)[..., None]
            frames = F.pad(frames, (0, 0, 0, -T % self.stride))
            frames = frames.reshape(B, -1, self.stride * C)
        return super().forward(frames), stacked(lens, self.stride)


def embed_inputs(
    encoder: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    projector: Projector,
    embed: nn.Embedding,
    batch: Batch,
    seq_len: int,
    plan: EncoderPlan | None = None,
) -> tuple[torch.Tensor, SequenceLayout]:
    """The decoder's input (B, seq_len, d): each example's tokens with its projected audio
    segments where they go, then zeros; and where each lies. ``plan``: the segments that hold
    audio, the only ones encoded, and how they are packed (``encode_audio``)."""
    features, feature_lens = segments(batch.features, batch.feature_lens)
    audio, audio_lens = encode_audio(encoder, projector, features, feature_lens, plan)
    layout = batch_layout(batch, audio_lens, seq_len)
    return splice(audio, embed(batch.tokens), layout), layout


def encode_audio(
    encoder: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    projector: Projector,
    features: torch.Tensor,
    feature_lens: torch.Tensor,
    plan: EncoderPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The projected audio (B, K, A, d) of each example's segments (B, K, T, bins), and its
    lengths (B, K): every segment of the batch encoded on its own, as one batch. Features
    shorter than ``MIN_FEATURE_FRAMES`` (a batch of text-only examples has none) are
    zero-padded to it: the encoder runs on every batch, so every rank of a sharded encoder runs
    the same collectives in every step whatever its batch holds; segments without frames get
    none. ``plan`` (``train.models.frame_packing.encoder_plan``, read on the host): its rows
    are the flat (B x K) indices of the segments to encode (the others, which hold no audio,
    are zeros without being encoded), its packing how the encoder packs their frames."""
    B, K = feature_lens.shape
    flat, lens = features.flatten(0, 1), feature_lens.flatten()
    rows = None if plan is None else plan.rows
    if rows is not None:
        flat, lens = flat.index_select(0, rows), lens.index_select(0, rows)
    if plan is not None and plan.packing is not None:
        encoded = encoder(flat, lens, plan.packing)
    else:
        if flat.shape[1] < MIN_FEATURE_FRAMES:
            flat = F.pad(flat, (0, 0, 0, MIN_FEATURE_FRAMES - flat.shape[1]))
        encoded = encoder(flat, lens)
    audio, audio_lens = projector(*encoded)
    if rows is not None:
        audio = audio.new_zeros((B * K, *audio.shape[1:])).index_copy(0, rows, audio)
        audio_lens = audio_lens.new_zeros(B * K).index_copy(0, rows, audio_lens)
    return audio.unflatten(0, (B, K)), audio_lens.unflatten(0, (B, K))


def build_encoder(cfg: SALMConfig) -> nn.Module:
    """The encoder ``cfg`` names: ``AudioEncoder``, or a pretrained family's module (the same
    interface: features and lengths in, frames and lengths out)."""
    if cfg.encoder == OWN_ENCODER:
        return AudioEncoder(cfg)
    return pretrained_encoder(cfg)


class SALM(nn.Module):
    """Audio encoder + projector + LLM; `forward` returns loss sums for one (local) batch."""

    def __init__(self, cfg: SALMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder: nn.Module | None = build_encoder(cfg)
        self.projector: Projector | None = Projector(cfg.enc_dim, cfg.d_model, cfg.projector_stride)
        self.llm = Decoder(cfg)
        self.seq_multiple = BASE_SEQ_MULTIPLE  # parallelize sets the layout's (tp, cp)
        self.loss_chunk = DEFAULT_LOSS_CHUNK  # and train.loss_chunk
        # A frozen encoder's kept outputs (train.encoder_cache_mb): the trainer sets it.
        self.encoder_cache: EncoderCache | None = None

    def forward(
        self,
        batch: Batch,
        seq_len: int | None = None,
        encoder_keys: EncoderKeys | None = None,
        encoder_plan: EncoderPlan | None = None,
    ) -> SALMOutput:
        """``seq_len``: the packed decoder length, ``packed_length`` of the batch's lengths
        while they are still on the host (the training step passes it, so that nothing is read
        back from the device); None computes it here from the lengths given. ``encoder_keys``:
        the batch's keys into ``encoder_cache``, which then gives the encoder's frames.
        ``encoder_plan``: the segments that hold audio and how the encoder packs them, read on
        the host as well (None: encode every segment, empty ones too, padded)."""
        if seq_len is None:
            audio = example_positions(self.cfg, batch.feature_lens)
            seq_len = packed_length(longest_example(audio, batch.token_lens), self.seq_multiple)
        encoder = self.encoder
        if self.encoder_cache is not None and encoder_keys is not None:
            encoder = partial(self.encoder_cache.encode, encoder_keys)
        x, layout = embed_inputs(
            encoder, self.projector, self.llm.embed, batch, seq_len, encoder_plan
        )
        x, token_mask, labels = self.llm.enter(x, layout.token_mask, layout.labels)
        x, aux = self.llm(x, token_mask, head=False)
        return SALMOutput(
            self.llm.head_loss(x, labels, self.loss_chunk),
            (labels != IGNORE_INDEX).sum(),
            aux_weight(self.cfg) * aux,
        )


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
