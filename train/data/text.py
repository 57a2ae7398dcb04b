"""The text side of a training example: the byte tokenizer of the project's own models, or a
pretrained LLM's tokenizer and chat template (``train.data.prompt``).

Both give what the data pipeline, the trainer and the evaluation need: ``example(transcript)``
(the tokens, where the audio goes, where the answer starts), ``generation_prompt()``,
``decode(ids)``, ``eos_ids`` and ``pad_id``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from train.config import ConfigError, ModelConfig
from train.data.conversation import ASSISTANT, Turn, messages
from train.data.prompt import AUDIO_TOKEN, DEFAULT_PROMPT, ChatPrompt, Encoded, load_tokenizer
from train.models.shape import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus pad, bos and eos: the project's own models' text.

    An example is the audio, then BOS, the transcript's bytes and EOS; the loss covers every
    token after BOS (a pretrained LLM's examples follow its chat template: ``train.data.prompt``).
    """

    pad_id, bos_id, eos_id, vocab_size = PAD_ID, BOS_ID, EOS_ID, VOCAB_SIZE
    eos_ids = frozenset({EOS_ID})

    def encode(self, text: str) -> list[int]:
        return [BOS_ID, *text.encode("utf-8"), EOS_ID]

    def for_tags(self, tags: Mapping[str, Any]) -> ByteTokenizer:
        """The same codec whatever a cut's tags: the byte tokenizer has no prompt (a source
        with ``prompt:`` tags is refused before training, train/data/sources.py)."""
        return self

    def example(self, text: str) -> Encoded:
        """A training example: no prompt before the audio, the answer after BOS."""
        tokens = self.encode(text)
        return Encoded(tokens, audio_at=(0,), spans=((1, len(tokens)),))

    def conversation(self, turns: Sequence[Turn]) -> Encoded:
        """A conversation (``train.data.conversation``): BOS, then each message's bytes, each audio
        where its turn is; a user or system message ends with a newline, an assistant message
        (the loss's) with EOS."""
        tokens, spans, audio_at = [BOS_ID], [], []
        for message in messages(turns):
            if message.role == ASSISTANT:
                answer = [*message.text.encode("utf-8"), EOS_ID]
                spans.append((len(tokens), len(tokens) + len(answer)))
                tokens += answer
                continue
            for index, part in enumerate(message.parts):
                if part is None:
                    audio_at.append(len(tokens))
                elif part:
                    tokens += f"{' ' if index else ''}{part}".encode()
            tokens += b"\n"
        return Encoded(tokens, tuple(audio_at), tuple(spans))

    def generation_prompt(self) -> Encoded:
        return Encoded([BOS_ID], audio_at=(0,))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


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
