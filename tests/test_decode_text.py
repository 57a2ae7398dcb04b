"""Greedy decoding after text chat prompts on the real SmolLM2-135M-Instruct (``make
pretrained``): the project's batched, left-padded, cached decoding against transformers'
``generate`` on each prompt alone, token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from recipes.pretrained import SMOLLM2
from tests.harness.hf_tiny import save_tiny_tokenizer
from tests.harness.models import pretrained_model
from train.data.prompt import generation_config_eos, load_tokenizer, text_prompt
from train.eval.decode import greedy_decode_text
from train.models.hf_config import decoder_fields
from train.models.hf_weights import load_llm_weights
from train.models.salm import SALM
from train.models.shape import SALMConfig

MAX_NEW = 20
QUESTIONS = (
    "What is the capital of France?",
    "Name three colors.",
    "What is 2+3?",
    "Explain in one sentence why the sky looks blue during the day but red at sunset.",
)


def one_rank(mine: bool) -> bool:
    return mine


@pytest.fixture(scope="module")
def smollm2() -> dict:
    """The project's SALM with SmolLM2's decoder, transformers' own model of the same folder,
    the tokenizer, the chat prompts and their eos ids."""
    directory = pretrained_model(SMOLLM2.name)
    ours = SALM(SALMConfig(**decoder_fields(directory)))
    load_llm_weights(ours, directory)
    tokenizer = load_tokenizer(directory)
    return {
        "ours": ours.eval(),
        "theirs": AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval(),
        "tokenizer": tokenizer,
        "prompts": [text_prompt(tokenizer, question) for question in QUESTIONS],
        "eos_ids": frozenset({tokenizer.eos_token_id} | generation_config_eos(tokenizer)),
    }


@pytest.fixture(scope="module")
def batched(smollm2) -> list[list[int]]:
    """The prompts decoded together, left-padded, with the KV cache."""
    return greedy_decode_text(
        smollm2["ours"], smollm2["prompts"], MAX_NEW, one_rank, smollm2["eos_ids"]
    )


def generate_alone(model, prompt: list[int], eos_ids: frozenset[int]) -> list[int]:
    """transformers' greedy continuation of one prompt, up to its first eos (excluded)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False
    )
    new = out[0, len(prompt) :].tolist()
    return next((new[:index] for index, token in enumerate(new) if token in eos_ids), new)


def test_prompts_of_different_lengths_decode_as_transformers_generates_each_alone(smollm2, batched):
    """Left padding, the cached prefill and the (1, B) steps change no greedy token; answers
    that end (eos) and one cut at MAX_NEW are both among them."""
    prompts = smollm2["prompts"]
    assert len({len(prompt) for prompt in prompts}) > 1
    expected = [generate_alone(smollm2["theirs"], p, smollm2["eos_ids"]) for p in prompts]
    assert batched == expected
    assert "Paris" in smollm2["tokenizer"].decode(batched[0])
    assert any(0 < len(ids) < MAX_NEW for ids in batched)
    assert any(len(ids) == MAX_NEW for ids in batched)


def test_recomputing_every_step_equals_the_cache(smollm2, batched):
    few = 6
    shortest, longest = 1, 3
    prompts = [smollm2["prompts"][shortest], smollm2["prompts"][longest]]
    recomputed = greedy_decode_text(
        smollm2["ours"], prompts, few, one_rank, smollm2["eos_ids"], use_cache=False
    )
    assert recomputed == [batched[shortest][:few], batched[longest][:few]]


def test_a_batch_padded_to_a_multiple_returns_only_its_own_sequences(smollm2, batched):
    few = 6
    padded = greedy_decode_text(
        smollm2["ours"], smollm2["prompts"][:1], few, one_rank, smollm2["eos_ids"], batch_multiple=3
    )
    assert padded == [batched[0][:few]]


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ([], "no prompts to decode"),
        ([[1, 2], []], "prompt 1 is empty"),
        ([[1, 49152]], "prompt 0 has token id 49152 outside the model's vocabulary"),
        ([[-1]], "prompt 0 has token id -1 outside"),
    ],
)
def test_prompts_that_cannot_be_decoded_are_refused_in_one_line(smollm2, prompts, message):
    with pytest.raises(ValueError, match=message) as caught:
        greedy_decode_text(smollm2["ours"], prompts, 2, one_rank, smollm2["eos_ids"])
    assert "\n" not in str(caught.value)


def test_text_prompt_is_the_templates_generation_prompt(smollm2):
    tokenizer = smollm2["tokenizer"]
    for system in (None, "Answer briefly."):
        messages = [{"role": "user", "content": QUESTIONS[0]}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        assert text_prompt(tokenizer, QUESTIONS[0], system) == expected["input_ids"]
    assert "You are a helpful AI assistant" in tokenizer.decode(smollm2["prompts"][0])


def test_text_prompt_without_a_chat_template_is_the_plain_format(tmp_path: Path):
    tokenizer = load_tokenizer(save_tiny_tokenizer("plain", tmp_path / "plain"))
    assert tokenizer.chat_template is None
    ids = text_prompt(tokenizer, "hello there", "be kind")
    assert tokenizer.decode(ids) == "<s>be kind\nhello there\n"


@pytest.mark.parametrize("text", ["stop<|im_end|>here", "an <|audio|> token"])
def test_text_prompt_refuses_special_tokens(smollm2, text):
    with pytest.raises(ValueError, match="contains the special token"):
        text_prompt(smollm2["tokenizer"], text)
    with pytest.raises(ValueError, match="the system text"):
        text_prompt(smollm2["tokenizer"], "hi", system=text)
