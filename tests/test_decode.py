"""Greedy decoding with a KV cache against decoding through the training forward."""

from __future__ import annotations

import torch

from train.decode import greedy_decode
from train.models.build import build_model
from train.models.presets import get_preset
from train.models.salm import BOS_ID, EOS_ID, embed_inputs, encoder_lens
from train.step import host_seq_len

MAX_NEW = 12


def model_and_audio():
    model = build_model(get_preset("tiny"), torch.device("cpu"), init_seed=1234).eval()
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(3, 120, 80, generator=generator)
    return model, features, torch.tensor([120, 64, 90])


@torch.no_grad()
def decode_through_training_forward(model, features, length) -> list[int]:
    """One utterance, no padding, no cache: the training layout (audio, then the tokens so
    far) and the logits at the last text position."""
    tokens = [BOS_ID]
    feats, lens = features[None, :length], torch.tensor([length])
    for _ in range(MAX_NEW):
        batch = (feats, lens, torch.tensor([tokens]), torch.tensor([len(tokens)]))
        seq_len = host_seq_len(batch, model.seq_multiple)
        x, layout = embed_inputs(model.encoder, model.projector, model.llm.embed, batch, seq_len)
        logits, _ = model.llm(x, layout.token_mask)
        next_token = int(logits[0, int(encoder_lens(lens)[0]) + len(tokens) - 1].argmax())
        if next_token == EOS_ID:
            break
        tokens.append(next_token)
    return tokens[1:]


def test_batched_cached_decoding_equals_one_utterance_at_a_time():
    model, features, lens = model_and_audio()
    batched = greedy_decode(model, features, lens, MAX_NEW, lambda mine: mine)
    pairs = zip(features, lens, strict=True)
    alone = [decode_through_training_forward(model, f, int(n)) for f, n in pairs]
    assert batched == alone
    assert all(len(ids) > 0 for ids in batched)


def test_the_cache_changes_nothing_but_the_work():
    model, features, lens = model_and_audio()
    cached = greedy_decode(model, features, lens, MAX_NEW, lambda mine: mine)
    recomputed = greedy_decode(model, features, lens, MAX_NEW, lambda mine: mine, use_cache=False)
    assert cached == recomputed


def test_a_padded_batch_returns_only_its_own_sequences():
    model, features, lens = model_and_audio()
    padded = greedy_decode(model, features, lens, MAX_NEW, lambda mine: mine, batch_multiple=4)
    assert padded == greedy_decode(model, features, lens, MAX_NEW, lambda mine: mine)
