"""Conversations and text users bring, as lhotse cuts carrying their turns
(``train.data.conversation``), so that they mix, bucket, shuffle and resume as speech does.

Two source kinds (``train.data.sources``):

- ``conversations``: JSON-lines files, one conversation per line, in any of the forms NeMo
  reads: its ``multimodal_conversation`` lines (``{"id", "conversations": [{"from": "User" |
  "Assistant", "type": "text" | "audio", "value": text or audio path, "duration"}]}``), ShareGPT
  lines (``{"id", "sound": audio path, "conversations": [{"from": "human" | "gpt", "value"}]}``,
  ``<sound>`` or ``<speech>`` in a turn's text marking where the audio goes) and NeMo's SFT lines
  (``{"system", "conversations": [{"from": "User" | "Assistant", "value"}]}``). A relative audio
  path is looked up beside the file first (NeMo's ``get_full_path``).
- ``text_pairs``: a source file and a target file, line by line (NeMo's ``txt_pair``): the user
  says the source (after a question from ``questions``, when given: the line's by its number),
  the assistant answers the target.

A conversation is a cut without a recording of its own (``train.data.conversation``): its audio
turns' recordings (each read from the file's header, unless the turn gives its ``duration`` and
``sampling_rate``) ride in ``cut.custom``, and its duration, what the batch budget and the
buckets count, is their seconds plus its characters times ``TEXT_CHAR_SECONDS``. Files are
read again on each pass: nothing is held.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from lhotse import Recording
from lhotse.cut import Cut, MonoCut

from train.data.conversation import (
    ASSISTANT,
    AUDIO_KEY,
    CONVERSATION_KEY,
    SYSTEM,
    USER,
    Turn,
)
from train.data.nemo_manifest import audio_path, json_lines, recording_of

# A text example's weight in the batch budget: 20 ms per character, about what a token's
# position costs next to audio (a token is some 4 characters; an audio position 40 to 80 ms).
TEXT_CHAR_SECONDS = 0.02
AUDIO_PLACEHOLDERS = ("<sound>", "<speech>")  # ShareGPT's marks for the audio (NeMo's)
ROLE_NAMES = {
    "user": USER,
    "human": USER,
    "assistant": ASSISTANT,
    "gpt": ASSISTANT,
    "system": SYSTEM,
}


def conversation_cut(
    cut_id: str, turns: Sequence[Turn], recordings: Sequence[Recording] = ()
) -> MonoCut:
    """The cut of a conversation: no recording of its own, its audio turns' ``recordings`` (in
    order) in ``custom``, its duration what the batch budget counts: their seconds, plus its
    text's characters times ``TEXT_CHAR_SECONDS``."""
    chars = sum(len(turn.text) for turn in turns)
    seconds = sum(recording.duration for recording in recordings)
    custom: dict[str, Any] = {CONVERSATION_KEY: [turn.as_json() for turn in turns]}
    if recordings:
        custom[AUDIO_KEY] = [recording.to_dict() for recording in recordings]
    return MonoCut(
        id=cut_id,
        start=0.0,
        duration=round(seconds + max(chars, 1) * TEXT_CHAR_SECONDS, 4),
        channel=0,
        custom=custom,
    )


def turn_recordings(cut: Cut) -> list[Recording] | None:
    """The recordings of a conversation cut's audio turns, in order; None for any other cut."""
    custom = cut.custom or {}
    if CONVERSATION_KEY not in custom:
        return None
    # from_dict consumes the mapping it is given: read copies, so the cut can be read again.
    return [Recording.from_dict(copy.deepcopy(given)) for given in custom.get(AUDIO_KEY, [])]


def audio_segments(cut: Cut) -> list[Cut]:
    """The cuts of ``cut``'s audio segments, in order, as the encoder takes them one by one: a
    conversation's audio turns (none for one of text only), or a speech cut itself."""
    recordings = turn_recordings(cut)
    return [cut] if recordings is None else [recording.to_cut() for recording in recordings]


def line_cut(
    line: Mapping[str, Any],
    path: Path,
    number: int,
    placeholders: Sequence[str] = AUDIO_PLACEHOLDERS,
) -> MonoCut:
    """The cut of one conversation line (module docstring); a line that is not a conversation
    is a ValueError naming it."""
    where = f"{path}: conversation {number + 1}"
    given = line.get("conversations")
    if not isinstance(given, list) or not given:
        raise ValueError(f"{where}: expected a non-empty conversations: list of turns")
    cut_id = str(line.get("id", f"{path.stem}-{number}"))
    turns: list[Turn] = []
    audio: list[tuple[str, Mapping[str, Any]]] = []
    sound = line.get("sound") or line.get("ori_sound")
    for turn in given:
        named = str(turn.get("from", "")).lower() if isinstance(turn, Mapping) else ""
        role = ROLE_NAMES.get(named)
        if role is None:
            raise ValueError(f"{where}: a turn's from: must be one of {', '.join(ROLE_NAMES)}")
        value = str(turn.get("value", ""))
        if turn.get("type") == "audio":
            audio.append((value, turn))
            turns.append(Turn(role, audio=True))
            continue
        mark = next((m for m in placeholders if sound and m in value), None)
        if mark is None:
            turns.append(Turn(role, value.strip()))
            continue
        before, after = value.split(mark, 1)
        audio.append((str(sound), {}))
        turns += [Turn(role, before.strip()), Turn(role, audio=True), Turn(role, after.strip())]
    turns = [turn for turn in turns if turn.audio or turn.text]
    if line.get("system") and turns[0].role != SYSTEM:  # NeMo's SFT lines
        turns.insert(0, Turn(SYSTEM, str(line["system"])))
    recordings = []
    for value, turn in audio:
        seconds = turn.get("duration")
        rate = turn.get("sampling_rate") if seconds else None
        recordings.append(recording_of(audio_path(value, path), rate, seconds or 0.0))
    return conversation_cut(cut_id, turns, recordings)


class ConversationCuts:
    """The cuts of ``conversations`` files, in order (a lhotse-iterable)."""

    def __init__(
        self, paths: Sequence[Path], placeholders: Sequence[str] = AUDIO_PLACEHOLDERS
    ) -> None:
        self.paths, self.placeholders = [Path(p) for p in paths], tuple(placeholders)

    def __iter__(self) -> Iterator[MonoCut]:
        for path in self.paths:
            for number, line in enumerate(json_lines(path)):
                yield line_cut(line, path, number, self.placeholders)


class TextPairCuts:
    """The cuts of a ``text_pairs`` source, its paths the source files then as many target
    files: line ``i`` of a source file as the user's turn (after question ``i`` modulo their
    number, when ``questions`` is given), line ``i`` of its target file as the assistant's (a
    lhotse-iterable)."""

    def __init__(self, paths: Sequence[Path], questions: str | None = None) -> None:
        half = len(paths) // 2
        self.pairs = list(zip(map(Path, paths[:half]), map(Path, paths[half:]), strict=True))
        self.questions = Path(questions) if questions else None

    def __iter__(self) -> Iterator[MonoCut]:
        asked = []
        if self.questions is not None:
            asked = [q.strip() for q in self.questions.read_text().splitlines() if q.strip()]
        for source, target in self.pairs:
            with open(source, encoding="utf-8") as said, open(target, encoding="utf-8") as answers:
                for number, (text, reply) in enumerate(itertools.zip_longest(said, answers)):
                    if text is None or reply is None:
                        raise ValueError(
                            f"{source} and {target} have different numbers of lines (one ends "
                            f"at line {number + 1})"
                        )
                    question = asked[number % len(asked)] if asked else ""
                    user = f"{question} {text.strip()}".strip()
                    turns = [Turn(USER, user), Turn(ASSISTANT, reply.strip())]
                    yield conversation_cut(f"{source.stem}-{number}", turns)
