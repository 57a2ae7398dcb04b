"""Tiny Hugging Face models and tokenizers in the formats of real LLM families, built offline
and written by ``save_pretrained`` (nothing downloaded).

``save_tiny_encoder(kind, directory)`` writes a random speech encoder as a real checkpoint holds
it (a WhisperForConditionalGeneration or WhisperModel, a ParakeetEncoder or ParakeetForCTC) with
its feature extractor's config beside it.

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
    ParakeetCTCConfig,
    ParakeetEncoder,
    ParakeetEncoderConfig,
    ParakeetFeatureExtractor,
    ParakeetForCTC,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
    WhisperModel,
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


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its biases and norms (scales, shifts, running statistics) moved off their
    initial constants, so that a mapping that drops them shows."""
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point() and ("bias" in name or "norm" in name):
                tensor.add_(torch.randn_like(tensor) * 0.1)
                if name.endswith("running_var"):
                    tensor.abs_()  # a variance stays positive
    return model


def save_tiny(family: str, directory: Path, dtype: torch.dtype = torch.float32) -> Path:
    """A random ``family`` decoder and its tokenizer in ``directory``, as ``save_pretrained``
    writes them; biases and norms perturbed."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[family](), dtype=dtype)
    perturbed(model).save_pretrained(directory)
    save_tiny_tokenizer(family, directory)
    return directory


WHISPER = {
    "d_model": 32,
    "encoder_layers": 2,
    "encoder_attention_heads": 4,
    "encoder_ffn_dim": 64,
    "decoder_layers": 1,
    "decoder_attention_heads": 4,
    "decoder_ffn_dim": 64,
    "num_mel_bins": 80,
    "vocab_size": 64,
    "max_target_positions": 16,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 3,
}
PARAKEET = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "subsampling_conv_channels": 8,
    "conv_kernel_size": 5,
    "dropout": 0.0,
    "attention_dropout": 0.0,
    "activation_dropout": 0.0,
}
# A checkpoint kind -> (how to build it, its family's feature extractor), each as real
# checkpoints hold the encoder: under model.encoder., encoder., or alone.
ENCODER_KINDS = {
    "whisper": (lambda: WhisperForConditionalGeneration(WhisperConfig(**WHISPER)), "whisper"),
    "whisper_model": (lambda: WhisperModel(WhisperConfig(**WHISPER)), "whisper"),
    "parakeet": (lambda: ParakeetEncoder(ParakeetEncoderConfig(**PARAKEET)), "parakeet"),
    "parakeet_ctc": (
        lambda: ParakeetForCTC(
            ParakeetCTCConfig(encoder_config=PARAKEET, vocab_size=32, pad_token_id=31)
        ),
        "parakeet",
    ),
}


def save_tiny_encoder(kind: str, directory: Path) -> Path:
    """A random tiny speech encoder checkpoint of ``kind`` (one of ENCODER_KINDS) and its
    feature extractor's config in ``directory``, as ``save_pretrained`` writes them."""
    torch.manual_seed(0)
    build, family = ENCODER_KINDS[kind]
    perturbed(build()).save_pretrained(directory)
    extractor = WhisperFeatureExtractor(feature_size=80) if family == "whisper" else None
    (extractor or ParakeetFeatureExtractor()).save_pretrained(directory)
    return directory


TOKENIZER_FAMILIES = ("llama", "qwen2", "qwen3", "plain")
# What each family's template writes to end the assistant's turn (SmolLM2's real one included):
# the last token the loss covers.
END_OF_TURN = {
    "llama": "<|eot_id|>",
    "qwen2": "<|im_end|>",
    "qwen3": "<|im_end|>",
    "plain": "</s>",
    "smollm2": "<|im_end|>",
}
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
