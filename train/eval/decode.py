"""Greedy decoding of transcripts from audio, or of answers to token prompts, with a KV cache,
batched and padding-aware.

Each sequence's prompt is its generation prompt's tokens around its projected audio frames (the
byte tokenizer's: the audio then BOS; a pretrained LLM's: its chat template up to the answer,
``train.data.prompt``), or a text chat's generation prompt alone (``greedy_decode_text``),
left-padded to the batch's longest (rounded up to the model's sequence multiple, which includes
the TP degree); then one token per step for every sequence until all have produced an end token
or ``max_new_tokens``: both kinds of prompt take the very same steps. Sharded layers (FSDP, TP,
EP) communicate in every forward, so the ranks decide together when to stop (``any_active``),
and a rank whose batch is done keeps stepping with the others.

Under pipeline parallelism each rank holds one stage (``Stages``): the first embeds and runs its
blocks, each stage sends its hidden states to the next, the last computes the logits and
broadcasts the chosen tokens back to every stage, whose KV caches then take the next step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import count

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.utils.rnn import pad_sequence

from train.data.prompt import Encoded
from train.data.text import ByteTokenizer
from train.models.batch import Batch
from train.models.frame_packing import encoder_plan
from train.models.kv_cache import KVCache
from train.models.packing import (
    example_positions,
    longest_example,
    packed_length,
    segments,
    sequence_layout,
    splice,
)
from train.models.salm import SALM, encode_audio
from train.models.shape import BOS_ID, EOS_ID, audio_positions


@dataclass(frozen=True)
class Stages:
    """This rank's place in a pipeline: its neighbours and the last stage, as global ranks."""

    group: dist.ProcessGroup
    previous: int | None
    next: int | None
    last: int

    @classmethod
    def of(cls, group: dist.ProcessGroup) -> Stages:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        global_rank = lambda stage: dist.get_global_rank(group, stage)  # noqa: E731
        return cls(
            group,
            global_rank(rank - 1) if rank > 0 else None,
            global_rank(rank + 1) if rank < size - 1 else None,
            global_rank(size - 1),
        )


BYTE_PROMPT = ByteTokenizer().generation_prompt()


def prompt_layout(
    model: nn.Module, feature_lens: torch.Tensor, prompts: list[Encoded]
) -> tuple[int, torch.Tensor]:
    """The prompt length (each sequence's prompt tokens and audio segments, the longest rounded
    up to the sequence multiple of ``model``, whole or a stage) and where each sequence's first
    real position is: known from the lengths alone, on every pipeline stage."""
    audio_lens = example_positions(model.cfg, feature_lens)
    text = torch.tensor([len(p.tokens) for p in prompts], device=audio_lens.device)
    length = packed_length(longest_example(audio_lens, text), model.seq_multiple)
    return length, length - text - audio_lens


def prompt_embeddings(
    model: nn.Module,
    features: torch.Tensor,
    feature_lens: torch.Tensor,
    length: int,
    prompts: list[Encoded],
) -> torch.Tensor:
    """Left-padded prompts (B, length, d): each sequence's prompt tokens with its audio segments
    where its prompt puts them (the byte tokenizer's: the audio, then BOS), laid out as training
    lays them out."""
    features, feature_lens = segments(features, feature_lens)
    plan = encoder_plan(model.cfg, model.encoder, feature_lens.cpu()).to(features.device)
    audio, audio_lens = encode_audio(model.encoder, model.projector, features, feature_lens, plan)
    device = audio.device
    tokens = pad_sequence(
        [torch.tensor(p.tokens, device=device) for p in prompts], batch_first=True
    )
    token_lens = torch.tensor([len(p.tokens) for p in prompts], device=device)
    audio_at = pad_sequence(
        [torch.tensor(p.audio_at or (0,), dtype=torch.long, device=device) for p in prompts],
        batch_first=True,
    )
    if audio_at.shape[1] != audio_lens.shape[1]:
        raise ValueError(
            f"greedy_decode: the prompts place {audio_at.shape[1]} audio segments, the "
            f"features hold {audio_lens.shape[1]}"
        )
    starts = length - token_lens - audio_lens.sum(-1)
    no_targets = torch.zeros_like(tokens, dtype=torch.bool)
    layout = sequence_layout(
        audio_lens, tokens, token_lens, length, audio_at, no_targets, offsets=starts
    )
    return splice(audio, model.llm.embed(tokens), layout)


@contextmanager
def kv_caches(model: nn.Module, key_valid: torch.Tensor):
    """Every decoder attention layer (of this stage) caches its keys and values."""
    layers = [block.attn for block in model.llm.layers.values()]
    for attn in layers:
        attn.kv_cache = KVCache(key_valid)
    try:
        yield
    finally:
        for attn in layers:
            attn.kv_cache = None


@torch.no_grad()
def initialize_sharding(model: nn.Module) -> None:
    """Run one forward of the model (or stage) on a dummy example, every rank once: FSDP2 sets
    itself up in its root's first forward, which decoding does not call."""
    device = next(model.parameters()).device
    lens = torch.tensor([16], device=device)
    tokens = torch.tensor([[BOS_ID, EOS_ID]], device=device)
    token_lens = torch.tensor([2], device=device)
    if isinstance(model, SALM):
        model(
            Batch(torch.zeros((1, 16, model.cfg.n_mels), device=device), lens, tokens, token_lens)
        )
        return
    model.aux_scale = torch.zeros((), device=device)  # a pipeline stage (PipelinePart)
    audio_lens = audio_positions(model.cfg, lens)
    length = packed_length(longest_example(audio_lens, token_lens), model.seq_multiple)
    token_mask = torch.ones((1, length), dtype=torch.bool, device=device)
    if model.encoder is not None:
        features = torch.zeros((1, 16, model.cfg.n_mels), device=device)
        model(features, lens, tokens, token_lens, token_mask=token_mask)
    else:
        model(torch.zeros((1, length, model.cfg.d_model), device=device), token_mask=token_mask)


@contextmanager
def gathered_root(model: nn.Module):
    """Under FSDP2 the root's own parameters (encoder convolutions, projector, embeddings,
    head) are gathered by its forward, which decoding does not call: gather them for it (after
    `initialize_sharding`)."""
    if not isinstance(model, FSDPModule):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


@torch.no_grad()
def greedy_decode(
    model: nn.Module,
    features: torch.Tensor,
    feature_lens: torch.Tensor,
    max_new_tokens: int,
    any_active: Callable[[bool], bool],
    use_cache: bool = True,
    batch_multiple: int = 1,
    stages: Stages | None = None,
    prompt: Encoded | Sequence[Encoded] = BYTE_PROMPT,
    eos_ids: frozenset[int] = ByteTokenizer.eos_ids,
) -> list[list[int]]:
    """The generated token ids of each sequence (up to its first of ``eos_ids``, excluded),
    after ``prompt`` around its audio (a generation prompt; or one per sequence, e.g. each
    conversation so far). ``any_active(mine)`` tells
    whether any rank still has a sequence to finish; ``use_cache=False`` recomputes the whole
    sequence at each step (the baseline the cache is measured against; whole models only).
    Under TP the batch, which decoding steps lay out as the sequence, is padded to a multiple of
    the TP degree (``batch_multiple``) with copies of its first sequence. ``stages``: this
    rank's pipeline stage, with ``model`` its part."""
    real = len(features)
    prompts = [prompt] * real if isinstance(prompt, Encoded) else list(prompt)
    if len(prompts) != real:
        raise ValueError(f"greedy_decode: {len(prompts)} prompts for {real} sequences")
    extra = -real % batch_multiple
    if extra:
        features = torch.cat([features, features[:1].expand(extra, *features.shape[1:])])
        feature_lens = torch.cat(
            [feature_lens, feature_lens[:1].expand(extra, *feature_lens.shape[1:])]
        )
        prompts += [prompts[0]] * extra
    length, starts = prompt_layout(model, feature_lens, prompts)
    generated = _Generated(len(features), max_new_tokens, eos_ids, any_active, features.device)
    with gathered_root(model):
        x = None
        if model.encoder is not None:
            x = prompt_embeddings(model, features, feature_lens, length, prompts)
        _decode_steps(model, x, length, starts, generated, use_cache, stages)
    return generated.rows(real)


@torch.no_grad()
def greedy_decode_text(
    model: nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    any_active: Callable[[bool], bool],
    eos_ids: frozenset[int],
    use_cache: bool = True,
    batch_multiple: int = 1,
    stages: Stages | None = None,
) -> list[list[int]]:
    """``greedy_decode`` after token prompts instead of audio (a text chat's generation prompt,
    ``train.data.prompt.text_prompt``): the prompts, of any lengths, are left-padded to the longest
    (rounded up to the model's sequence multiple). Every pipeline stage passes the same
    ``prompts``: their lengths lay out the batch."""
    _check_prompts(prompts, model.cfg.vocab_size)
    real = len(prompts)
    prompts = prompts + [prompts[0]] * (-real % batch_multiple)
    device = next(model.parameters()).device
    lens = torch.tensor([len(tokens) for tokens in prompts], device=device)
    length = packed_length(max(len(tokens) for tokens in prompts), model.seq_multiple)
    starts = length - lens
    generated = _Generated(len(prompts), max_new_tokens, eos_ids, any_active, device)
    with gathered_root(model):
        x = None
        if model.llm.embed is not None:
            x = model.llm.embed(_left_padded(prompts, length, device))
        _decode_steps(model, x, length, starts, generated, use_cache, stages)
    return generated.rows(real)


def _check_prompts(prompts: list[list[int]], vocab_size: int) -> None:
    """One line on the first prompt that cannot be decoded after: an empty one has no position
    to predict from, an id outside the vocabulary fails deep in the embedding (on a GPU, as an
    asynchronous device assert)."""
    if not prompts:
        raise ValueError("greedy_decode_text: no prompts to decode")
    for index, tokens in enumerate(prompts):
        if not tokens:
            raise ValueError(f"greedy_decode_text: prompt {index} is empty")
        outside = [token for token in tokens if not 0 <= token < vocab_size]
        if outside:
            raise ValueError(
                f"greedy_decode_text: prompt {index} has token id {outside[0]} outside the "
                f"model's vocabulary (0 to {vocab_size - 1})"
            )


def _left_padded(prompts: list[list[int]], length: int, device: torch.device) -> torch.Tensor:
    """The prompts as (B, length) ids, each right-aligned; the padding (id 0) is never seen."""
    rows = [[0] * (length - len(tokens)) + tokens for tokens in prompts]
    return torch.tensor(rows, dtype=torch.long, device=device)


class _Generated:
    """The greedy tokens of a batch, step by step: after a sequence's end token, eos fills
    its row; ``any_active`` decides with the other ranks when every sequence is done."""

    def __init__(
        self,
        batch: int,
        max_new_tokens: int,
        eos_ids: frozenset[int],
        any_active: Callable[[bool], bool],
        device: torch.device,
    ) -> None:
        self.eos_ids = eos_ids
        self.eos = torch.tensor(sorted(eos_ids), device=device)
        self.tokens = torch.full((batch, max_new_tokens), int(self.eos[0]), device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.any_active = any_active

    def record(self, step: int, next_token: torch.Tensor) -> bool:
        """Keep the step's tokens; whether to take another step (on every rank alike)."""
        self.tokens[:, step] = torch.where(self.finished, self.eos[0], next_token)
        self.finished |= torch.isin(next_token, self.eos)
        last = step + 1 == self.tokens.shape[1]
        return not last and self.any_active(not bool(self.finished.all()))

    def rows(self, real: int) -> list[list[int]]:
        """The first ``real`` sequences' ids, each up to its first end token."""
        return [_until_eos(row, self.eos_ids) for row in self.tokens[:real].tolist()]


def _decode_steps(
    model: nn.Module,
    x: torch.Tensor | None,
    length: int,
    starts: torch.Tensor,
    generated: _Generated,
    use_cache: bool,
    stages: Stages | None,
) -> None:
    """Greedy steps after the left-padded prompts ``x`` (B, length, d; None on a pipeline
    stage that receives them), sequence b's first real position at ``starts[b]``: shared by
    the audio and the text prompts."""
    max_new_tokens = generated.tokens.shape[1]
    positions = torch.arange(length + max_new_tokens, device=starts.device)
    key_valid = positions[None, :] >= starts[:, None]
    if use_cache:
        _cached_steps(model, x, key_valid, length, generated, stages)
    else:
        _recomputed_steps(model, x, key_valid, length, generated)


def _cached_steps(
    model: nn.Module,
    x: torch.Tensor | None,
    key_valid: torch.Tensor,
    length: int,
    generated: _Generated,
    stages: Stages | None,
) -> None:
    """One prefill of the prompts, then one new position per sequence and step, laid out
    (1, B): the batch as the sequence."""
    batch, device = len(key_valid), key_valid.device
    with kv_caches(model, key_valid):
        logits = _run_stage(model, x, (batch, length), key_valid[:, :length], None, stages)
        next_token = _chosen(logits, batch, stages, device)
        for step in count():
            if not generated.record(step, next_token):
                return
            new = model.llm.embed(next_token)[None] if x is not None else None
            positions = torch.full((batch,), length + step, device=device)
            ones = torch.ones((1, batch), dtype=torch.bool, device=device)
            logits = _run_stage(model, new, (1, batch), ones, positions, stages)
            next_token = _chosen(logits, batch, stages, device, step_layout=True)


def _recomputed_steps(
    model: nn.Module, x: torch.Tensor, key_valid: torch.Tensor, length: int, generated: _Generated
) -> None:
    """Every step runs the whole sequence so far (whole models only)."""
    sequence = x
    for step in count():
        seen = length + step
        with kv_caches(model, key_valid[:, :seen]):
            logits, _ = model.llm(sequence, key_valid[:, :seen])
        next_token = logits[:, -1].argmax(-1)
        if not generated.record(step, next_token):
            return
        sequence = torch.cat([sequence, model.llm.embed(next_token)[:, None]], dim=1)


def _run_stage(
    model: nn.Module,
    x: torch.Tensor | None,
    shape: tuple[int, int],
    token_mask: torch.Tensor,
    positions: torch.Tensor | None,
    stages: Stages | None,
) -> torch.Tensor | None:
    """This rank's blocks on ``x`` (received from the previous stage when None); the logits on
    the last stage, None on the others (which send their output on)."""
    if x is None:
        assert stages is not None and stages.previous is not None
        x = torch.empty((*shape, model.cfg.d_model), device=token_mask.device)
        dist.recv(x, src=stages.previous, group=stages.group)
    out, _ = model.llm(x, token_mask, positions=positions)
    if stages is not None and stages.next is not None:
        dist.send(out.contiguous(), dst=stages.next, group=stages.group)
        return None
    return out


def _chosen(
    logits: torch.Tensor | None,
    batch: int,
    stages: Stages | None,
    device: torch.device,
    step_layout: bool = False,
) -> torch.Tensor:
    """The greedy tokens of the last position (of each sequence, or of the step's (1, B)
    layout), broadcast from the last pipeline stage to the others."""
    if logits is not None:
        chosen = (logits[0] if step_layout else logits[:, -1]).argmax(-1)
    else:
        chosen = torch.empty(batch, dtype=torch.long, device=device)
    if stages is not None:
        dist.broadcast(chosen, src=stages.last, group=stages.group)
    return chosen


def _until_eos(ids: list[int], eos_ids: frozenset[int]) -> list[int]:
    return next((ids[:index] for index, token in enumerate(ids) if token in eos_ids), ids)
