"""Greedy decoding with a KV cache against decoding through the training forward, for the byte
tokenizer's prompt (audio, BOS) and for pretrained LLMs' chat templates (prompt tokens around the
audio): what training teaches is what decoding asks."""

from __future__ import annotations

import pytest
import torch

from tests.harness.hf_tiny import save_tiny
from train.config import ModelConfig
from train.data.prompt import Encoded
from train.data.text import ByteTokenizer, text_codec
from train.eval.decode import greedy_decode
from train.loop.step import host_seq_len
from train.models.batch import Batch
from train.models.build import build_model
from train.models.hf_weights import load_llm_weights
from train.models.loss import loss_targets
from train.models.packing import IGNORE_INDEX, sequence_layout
from train.models.presets import get_preset, model_shape
from train.models.salm import embed_inputs
from train.models.shape import audio_positions

MAX_NEW = 12


def model_and_audio():
    model = build_model(get_preset("tiny"), torch.device("cpu"), init_seed=1234).eval()
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(3, 120, 80, generator=generator)
    return model, features, torch.tensor([120, 64, 90])


@pytest.fixture(scope="module")
def chat_models(tmp_path_factory) -> dict:
    """Tiny pretrained Qwen2 (tied, ChatML) and Llama (Llama 3 headers) SALMs with their chat
    prompts."""
    models = {}
    for family in ("qwen2", "llama"):
        directory = save_tiny(family, tmp_path_factory.mktemp(family))
        config = ModelConfig(pretrained_llm=str(directory), prompt="Write down what is said.")
        shape = model_shape("tiny", str(directory))
        model = build_model(shape, torch.device("cpu"), init_seed=1234)
        load_llm_weights(model, directory)
        models[family] = (model.eval(), text_codec(config, shape.vocab_size))
    return models


@torch.no_grad()
def decode_through_training_forward(
    model, features, length, prompt: Encoded, eos_ids: frozenset[int]
) -> list[int]:
    """One utterance, no padding, no cache: the training layout (the prompt's tokens around
    the audio, then the answer so far) and the logits at the last text position."""
    tokens = list(prompt.tokens)
    feats, lens = features[None, :length], torch.tensor([length])
    for _ in range(MAX_NEW):
        batch = Batch(
            feats,
            lens,
            torch.tensor([tokens]),
            torch.tensor([len(tokens)]),
            torch.tensor([prompt.prefix_len]),
            torch.arange(len(tokens))[None, :] >= prompt.answer_start,
        )
        seq_len = host_seq_len(batch, model)
        x, layout = embed_inputs(model.encoder, model.projector, model.llm.embed, batch, seq_len)
        logits, _ = model.llm(x, layout.token_mask)
        next_token = int(
            logits[0, int(audio_positions(model.cfg, lens)[0]) + len(tokens) - 1].argmax()
        )
        if next_token in eos_ids:
            break
        tokens.append(next_token)
    return tokens[len(prompt.tokens) :]


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_a_chat_prompt_decodes_as_training_lays_it_out(chat_models, family):
    """Batched, cached decoding after the chat template's generation prompt equals the
    training forward's greedy continuation of the same prompt, utterance by utterance; and
    the training example of a transcript starts with exactly that prompt."""
    model, text = chat_models[family]
    _, features, lens = model_and_audio()
    prompt = text.generation_prompt()
    decode = lambda **kw: greedy_decode(  # noqa: E731
        model, features, lens, MAX_NEW, lambda mine: mine, prompt=prompt, eos_ids=text.eos_ids, **kw
    )
    batched = decode()
    pairs = zip(features, lens, strict=True)
    alone = [
        decode_through_training_forward(model, f, int(n), prompt, text.eos_ids) for f, n in pairs
    ]
    assert batched == alone
    assert batched == decode(use_cache=False)
    assert all(len(ids) > 0 for ids in batched)
    example = text.example("hello world")
    assert example.tokens[: example.answer_start] == prompt.tokens
    assert example.prefix_len == prompt.prefix_len


def test_batched_cached_decoding_equals_one_utterance_at_a_time():
    model, features, lens = model_and_audio()
    batched = greedy_decode(model, features, lens, MAX_NEW, lambda mine: mine)
    pairs = zip(features, lens, strict=True)
    byte = ByteTokenizer()
    alone = [
        decode_through_training_forward(model, f, int(n), byte.generation_prompt(), byte.eos_ids)
        for f, n in pairs
    ]
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


def test_the_loss_covers_the_answer_and_the_audio_sits_at_the_placeholder(chat_models):
    _, text = chat_models["qwen2"]
    examples = [text.example("hello world"), text.example("a much longer transcript here")]
    tokens = torch.nn.utils.rnn.pad_sequence(
        [torch.tensor(e.tokens) for e in examples], batch_first=True, padding_value=text.pad_id
    )
    token_lens = torch.tensor([len(e.tokens) for e in examples])
    prefix_lens = torch.tensor([e.prefix_len for e in examples])
    target_mask = torch.nn.utils.rnn.pad_sequence(
        [torch.tensor(e.target_mask()) for e in examples], batch_first=True
    )
    audio_lens = torch.tensor([7, 3])
    seq_len = int((audio_lens + token_lens).max()) + 5
    layout = sequence_layout(audio_lens, tokens, token_lens, seq_len, prefix_lens, target_mask)
    for row, (example, audio) in enumerate(zip(examples, audio_lens.tolist(), strict=True)):
        start = example.prefix_len
        assert layout.is_audio[row].nonzero().flatten().tolist() == list(
            range(start, start + audio)
        )
        labels = layout.labels[row][layout.labels[row] != IGNORE_INDEX].tolist()
        assert labels == example.tokens[example.answer_start :]
        assert text.decode(labels) in ("hello world", "a much longer transcript here")
    assert int(loss_targets(token_lens, target_mask)) == int((layout.labels != IGNORE_INDEX).sum())
