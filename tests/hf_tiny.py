"""Tiny Hugging Face models and tokenizers in the formats of real LLM families, built offline
and written by ``save_pretrained`` (nothing downloaded).

``save_tiny(family, directory)`` writes a random Llama, Qwen2 or Qwen3 decoder with its tokenizer:

A byte-level BPE (256 byte tokens plus a few merges learned from a short built-in text) tokenizes
any text without unknown tokens and stays under 290 ids, so it fits the tiny test models (vocab
301). Each family gets its special tokens and a chat template written here in the FORMAT of the
real family (Llama 3 headers, Qwen2 ChatML with its default system message, Qwen3 ChatML with
an empty ``<think>`` block before the answer); "plain" has no chat template at all.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from recipes.make_hf_llm import CHATML_TEMPLATE, QWEN2_EXTRA, QWEN2_SPECIALS, byte_level_bpe

SHARED = {
    "vocab_size": 301,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
}
FAMILIES = {
    # Llama with an untied head and a RoPE base of its own.
    "llama": lambda: LlamaConfig(**SHARED, rope_theta=50000.0, tie_word_embeddings=False),
    # Qwen2: q/k/v biases, tied embeddings, GQA.
    "qwen2": lambda: Qwen2Config(**SHARED, tie_word_embeddings=True),
    # Qwen3: heads wider than hidden / heads, q/k norms, tied embeddings.
    "qwen3": lambda: Qwen3Config(**SHARED, head_dim=32, tie_word_embeddings=True),
}


def save_tiny(family: str, directory: Path, dtype: torch.dtype = torch.float32) -> Path:
    """A random ``family`` decoder and its tokenizer in ``directory``, as ``save_pretrained``
    writes them; biases and norms perturbed so that a mapping that drops them shows."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[family](), dtype=dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "bias" in name or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory)
    save_tiny_tokenizer(family, directory)
    return directory


TOKENIZER_FAMILIES = ("llama", "qwen2", "qwen3", "plain")
MAX_LEN = 290  # the tiny test models have vocab 301; leave room for the audio placeholder

# Only words, spaces and punctuation: no newlines, so no whitespace merges that would make a
# piece tokenized alone differ from the same piece inside a rendered template.
TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Transcribe the audio. You are a helpful assistant, and the user is a system.",
    "She said: hello world! Is it 42 or 17? Yes; no (maybe) - 3.5% & 10/10.",
    "Grüße aus der Straße, café au lait, naïve über Ärger; déjà vu.",
    "THE END 0123456789 'quoted' \"double\" #1 @home *star* [x] {y} <z> a+b=c",
]
VOCAB_SIZE = 256 + 14  # bytes plus a few merges; the specials come on top

LLAMA_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

QWEN2_TEMPLATE = CHATML_TEMPLATE

QWEN3_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message['content']"
    " + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
)


def save_tiny_tokenizer(family: str, directory: Path) -> Path:
    """Write a tiny tokenizer of ``family`` (one of FAMILIES) to ``directory``; returns it."""
    if family == "llama":
        specials = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
        extra = ["<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>"]
        template: str | None = LLAMA_TEMPLATE
    elif family == "qwen2":
        specials, extra, template = QWEN2_SPECIALS, QWEN2_EXTRA, QWEN2_TEMPLATE
    elif family == "qwen3":
        specials, extra, template = QWEN2_SPECIALS, QWEN2_EXTRA, QWEN3_TEMPLATE
    elif family == "plain":
        specials = {"bos_token": "<s>", "eos_token": "</s>"}
        extra = []
        template = None
    else:
        raise ValueError(f"unknown tokenizer family {family!r}; one of {', '.join(FAMILIES)}")

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=byte_level_bpe(TEXT, VOCAB_SIZE), **specials, extra_special_tokens=extra
    )
    if family == "qwen3":
        tokenizer.add_tokens(["<think>", "</think>"])  # added but not special, as in Qwen3
    tokenizer.chat_template = template
    assert len(tokenizer) <= MAX_LEN, len(tokenizer)

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(directory)
    if family == "llama":
        eos = tokenizer.convert_tokens_to_ids(["<|eot_id|>", "<|end_of_text|>"])
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return directory
