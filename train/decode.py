"""Greedy decoding of transcripts from audio with a KV cache, batched and padding-aware.

Each sequence's prompt is its projected audio frames then BOS, left-padded to the batch's
longest (rounded up to the model's sequence multiple, which includes the TP degree); then one
token per step for every sequence until all have produced EOS or ``max_new_tokens``. Sharded
layers (FSDP, TP, EP) communicate in every forward, so the ranks decide together when to stop
(``any_active``), and a rank whose batch is done keeps stepping with the others.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch.distributed.fsdp import FSDPModule

from train.models.kv_cache import KVCache
from train.models.salm import BOS_ID, EOS_ID, SALM


def prompt_embeddings(
    model: SALM, features: torch.Tensor, feature_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts (B, P, d): each sequence's audio then BOS; and where they start."""
    audio, audio_lens = model.encoder(features, feature_lens)
    audio = model.projector(audio)
    batch = len(audio_lens)
    multiple = model.seq_multiple
    prompt = -(-(int(audio_lens.max()) + 1) // multiple) * multiple
    starts = prompt - 1 - audio_lens  # first real position of each sequence
    columns = torch.arange(prompt, device=audio.device)[None, :]
    is_audio = (columns >= starts[:, None]) & (columns < prompt - 1)
    audio_index = (columns - starts[:, None]).clamp(0, audio.shape[1] - 1)
    from_audio = audio.gather(1, audio_index[..., None].expand(-1, -1, audio.shape[-1]))
    bos = model.llm.embed(torch.full((batch, 1), BOS_ID, device=audio.device))
    x = torch.where(is_audio[..., None], from_audio, torch.zeros_like(from_audio))
    return torch.cat([x[:, :-1], bos], dim=1), starts


@contextmanager
def kv_caches(model: SALM, key_valid: torch.Tensor):
    """Every decoder attention layer caches its keys and values for this batch."""
    layers = [block.attn for block in model.llm.layers.values()]
    for attn in layers:
        attn.kv_cache = KVCache(key_valid)
    try:
        yield
    finally:
        for attn in layers:
            attn.kv_cache = None


@torch.no_grad()
def initialize_sharding(model: SALM) -> None:
    """Run one forward of the whole model on a dummy example (every rank, once): FSDP2 sets
    itself up in its root's first forward, which decoding does not call."""
    device = next(model.parameters()).device
    features = torch.zeros((1, 16, model.cfg.n_mels), device=device)
    tokens = torch.tensor([[BOS_ID, EOS_ID]], device=device)
    model(features, torch.tensor([16], device=device), tokens, torch.tensor([2], device=device))


@contextmanager
def gathered_root(model: SALM):
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
    model: SALM,
    features: torch.Tensor,
    feature_lens: torch.Tensor,
    max_new_tokens: int,
    any_active: Callable[[bool], bool],
    use_cache: bool = True,
    batch_multiple: int = 1,
) -> list[list[int]]:
    """The generated token ids of each sequence (EOS excluded). ``any_active(mine)`` tells
    whether any rank still has a sequence to finish; ``use_cache=False`` recomputes the whole
    sequence at each step (the baseline the cache is measured against). Under TP the batch,
    which decoding steps lay out as the sequence, is padded to a multiple of the TP degree
    (``batch_multiple``) with copies of its first sequence."""
    real = len(features)
    extra = -real % batch_multiple
    if extra:
        features = torch.cat([features, features[:1].expand(extra, -1, -1)])
        feature_lens = torch.cat([feature_lens, feature_lens[:1].expand(extra)])
    with gathered_root(model):
        x, starts = prompt_embeddings(model, features, feature_lens)
        batch, prompt = x.shape[:2]
        total = prompt + max_new_tokens
        key_valid = torch.arange(total, device=x.device)[None, :] >= starts[:, None]
        tokens = torch.full((batch, max_new_tokens), EOS_ID, device=x.device)
        finished = torch.zeros(batch, dtype=torch.bool, device=x.device)
        if use_cache:
            with kv_caches(model, key_valid):
                next_token = _last_logits(model, x, key_valid[:, :prompt]).argmax(-1)
                for step in range(max_new_tokens):
                    tokens[:, step] = torch.where(finished, EOS_ID, next_token)
                    finished |= next_token == EOS_ID
                    if step + 1 == max_new_tokens or not any_active(not bool(finished.all())):
                        break
                    new = model.llm.embed(next_token)[None]  # (1, B, d): the batch as sequence
                    positions = torch.full((batch,), prompt + step, device=x.device)
                    ones = torch.ones((1, batch), dtype=torch.bool, device=x.device)
                    logits, _ = model.llm(new, ones, positions=positions)
                    next_token = logits[0].argmax(-1)
        else:
            sequence = x
            for step in range(max_new_tokens):
                length = prompt + step
                with kv_caches(model, key_valid[:, :length]):
                    next_token = _last_logits(model, sequence, key_valid[:, :length]).argmax(-1)
                tokens[:, step] = torch.where(finished, EOS_ID, next_token)
                finished |= next_token == EOS_ID
                if step + 1 == max_new_tokens or not any_active(not bool(finished.all())):
                    break
                new = model.llm.embed(next_token)[:, None]
                sequence = torch.cat([sequence, new], dim=1)
    return [_until_eos(row) for row in tokens[:real].tolist()]


def _last_logits(model: SALM, x: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    logits, _ = model.llm(x, token_mask)
    return logits[:, -1]


def _until_eos(ids: list[int]) -> list[int]:
    return ids[: ids.index(EOS_ID)] if EOS_ID in ids else ids
