"""The text side of a training example: the byte tokenizer of the project's own models, or a
pretrained LLM's tokenizer and chat template (``train.prompt``).

Both give what the data pipeline, the trainer and the evaluation need: ``example(transcript)``
(the tokens, where the audio goes, where the answer starts), ``generation_prompt()``,
``decode(ids)``, ``eos_ids`` and ``pad_id``.
"""

from __future__ import annotations

from pathlib import Path

from train.config import ConfigError, ModelConfig
from train.models.salm import ByteTokenizer
from train.prompt import AUDIO_TOKEN, DEFAULT_PROMPT, ChatPrompt, load_tokenizer


def text_codec(model: ModelConfig, vocab_size: int) -> ByteTokenizer | ChatPrompt:
    """The codec of ``model``'s examples; a pretrained tokenizer must fit the ``vocab_size``
    rows of the model's embedding (all but the audio placeholder, which never reaches it). A
    problem is one ConfigError line."""
    if model.pretrained_llm is None:
        return ByteTokenizer()
    directory = Path(model.pretrained_llm).expanduser()
    try:
        tokenizer = load_tokenizer(directory)
        if len(tokenizer) - 1 > vocab_size:
            raise ValueError(
                f"{directory}: the tokenizer has {len(tokenizer) - 1} tokens (besides "
                f"{AUDIO_TOKEN}) but the model's embedding {vocab_size} rows; the tokenizer and "
                "config.json come from different models"
            )
        return ChatPrompt(tokenizer, model.prompt or DEFAULT_PROMPT, model.system)
    except ValueError as error:
        raise ConfigError(str(error)) from error
