"""A conversation as the trainer reads it: turns of text and of audio, each spoken by the
system, the user or the assistant.

A cut carries its conversation in ``cut.custom["conversation"]`` as a JSON list of turns,
``{"role": ..., "text": ...}`` or ``{"role": ..., "audio": true}``, and its audio turns'
recordings, in order, in ``cut.custom["audio"]`` (lhotse's recording manifests): the cut itself
has no recording, and its duration is what the batch budget counts. The readers of the formats
users bring (``train.data.conversation_cuts``) write them there; the text codecs
(``train.data.prompt`` for a pretrained LLM's chat template, the byte tokenizer of the presets)
render them, the loss covering the assistant's turns, and evaluation decodes the last assistant turn
after the rest.

Consecutive turns of one role are one message, their texts joined by a space (each audio turn's
place in it kept), as NeMo's SALM prompt formatting joins them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

CONVERSATION_KEY = "conversation"  # where a cut carries its turns (cut.custom)
AUDIO_KEY = "audio"  # where a conversation's cut carries its audio turns' recordings
# The source kinds whose cuts are conversations (train.data.sources, train.data.conversation_cuts).
CONVERSATIONS_KIND, TEXT_PAIRS_KIND = "conversations", "text_pairs"
SYSTEM, USER, ASSISTANT = "system", "user", "assistant"
ROLES = (SYSTEM, USER, ASSISTANT)


class ConversationError(ValueError):
    """A conversation the trainer cannot use; the message says what is wrong with it."""


@dataclass(frozen=True)
class Turn:
    """One turn: its role and its text, or the audio (``audio`` True, no text)."""

    role: str
    text: str = ""
    audio: bool = False

    def as_json(self) -> dict[str, Any]:
        if self.audio:
            return {"role": self.role, "audio": True}
        return {"role": self.role, "text": self.text}


@dataclass(frozen=True)
class Message:
    """Consecutive turns of one role: their texts, and None where an audio turn is."""

    role: str
    parts: tuple[str | None, ...]

    @property
    def text(self) -> str:
        """The message's text, its audio left out."""
        return " ".join(part for part in self.parts if part)

    @property
    def audio_turns(self) -> int:
        return sum(part is None for part in self.parts)

    def content(self, audio_token: str) -> str:
        """The message's text with ``audio_token`` where each audio goes."""
        return " ".join(audio_token if part is None else part for part in self.parts if part != "")


def turns_from_json(given: object) -> list[Turn]:
    """The turns of a cut's ``conversation`` field (module docstring), checked."""
    if not isinstance(given, list) or not given:
        raise ConversationError("a conversation is a non-empty list of turns")
    turns = []
    for index, item in enumerate(given):
        if not isinstance(item, Mapping) or item.get("role") not in ROLES:
            raise ConversationError(
                f"turn {index} needs a role: one of {', '.join(ROLES)} (got {item!r:.80})"
            )
        if item.get("audio"):
            turns.append(Turn(str(item["role"]), audio=True))
        elif isinstance(item.get("text"), str):
            turns.append(Turn(str(item["role"]), text=item["text"].strip()))
        else:
            raise ConversationError(f"turn {index} has neither text nor audio: {item!r:.80}")
    return turns


def messages(turns: Sequence[Turn]) -> list[Message]:
    """The conversation as messages (module docstring), checked: a system message only first,
    the user speaking before the assistant, the assistant last with some text, and no audio in
    the assistant's turns."""
    merged: list[Message] = []
    for turn in turns:
        if turn.audio and turn.role == ASSISTANT:
            raise ConversationError("an audio turn of the assistant cannot be trained on")
        part = None if turn.audio else turn.text
        if merged and merged[-1].role == turn.role:
            merged[-1] = Message(turn.role, (*merged[-1].parts, part))
        else:
            merged.append(Message(turn.role, (part,)))
    roles = [message.role for message in merged]
    if SYSTEM in roles[1:]:
        raise ConversationError("a system turn may only open a conversation")
    spoken = roles[1:] if roles[0] == SYSTEM else roles
    if not spoken or spoken[0] != USER:
        raise ConversationError("a conversation starts with the user (after a system turn)")
    if spoken[-1] != ASSISTANT or not merged[-1].text:
        raise ConversationError("a conversation ends with an assistant turn that has text")
    return merged


def conversation_of(custom: Mapping[str, Any] | None) -> list[Turn] | None:
    """The turns a cut's ``custom`` carries, or None for a plain speech cut."""
    given = (custom or {}).get(CONVERSATION_KEY)
    return None if given is None else turns_from_json(given)


def answer(turns: Sequence[Turn]) -> str:
    """The last assistant turn's text: what evaluation decodes and scores."""
    return messages(turns)[-1].text
