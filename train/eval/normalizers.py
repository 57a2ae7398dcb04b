"""Text normalizers: what a reference and a hypothesis are turned into before they are scored.

A WER is only comparable with another computed after the same normalization, so the choice is
named in every evaluation summary (``normalizer``). The registry (``NORMALIZERS``):

- ``none``: the text as it is, whitespace collapsed: casing and punctuation count as errors.
- ``basic`` (the default): Unicode NFKC, lower case, punctuation removed; nothing
  language-specific, so it suits any language.
- ``whisper_en``: the English normalizer of OpenAI's Whisper (the ``whisper-normalizer``
  package), which most published English WERs use (the Open ASR Leaderboard, NeMo's
  ``salm_eval.py``): it also expands contractions and abbreviations ("Mr." -> "mister"), writes
  numbers as digits, maps British to American spelling ("colour" -> "color") and drops
  hesitations ("uh") and bracketed noise tags.
"""

from __future__ import annotations

import functools
import unicodedata
from collections.abc import Callable

Normalizer = Callable[[str], str]
DEFAULT_NORMALIZER = "basic"
APOSTROPHES = ("'", "\u2019")  # ASCII and typographic; the latter is written as the former


def collapse_whitespace(text: str) -> str:
    """The text with every run of whitespace one space, none at either end."""
    return " ".join(text.split())


def basic(text: str) -> str:
    """Unicode NFKC, lowercased, every punctuation character (Unicode category P*) replaced by a
    space except an apostrophe (' or U+2019, kept as ') between two letters or digits, as in
    "don't", then whitespace collapsed.

    Nothing language-specific (no number spelling, contractions or spelling variants), so a
    hypothesis is judged on its words, not on casing, punctuation or spacing.
    """
    text = unicodedata.normalize("NFKC", text).lower()
    kept = []
    for i, char in enumerate(text):
        inside_word = 0 < i < len(text) - 1 and text[i - 1].isalnum() and text[i + 1].isalnum()
        if char in APOSTROPHES and inside_word:
            kept.append("'")
        elif unicodedata.category(char).startswith("P"):
            kept.append(" ")
        else:
            kept.append(char)
    return collapse_whitespace("".join(kept))


@functools.cache
def _whisper_english() -> Normalizer:
    """Built once, when first asked for: it reads its spelling map (~50 ms)."""
    from whisper_normalizer.english import EnglishTextNormalizer

    return EnglishTextNormalizer()


def whisper_en(text: str) -> str:
    """Whisper's English normalizer (module docstring)."""
    return collapse_whitespace(_whisper_english()(text))


NORMALIZERS: dict[str, Normalizer] = {
    "none": collapse_whitespace,
    "basic": basic,
    "whisper_en": whisper_en,
}


def normalizer(name: str) -> Normalizer:
    """The normalizer registered as ``name``; a ValueError line naming the choices otherwise."""
    try:
        return NORMALIZERS[name]
    except KeyError:
        raise ValueError(
            f"normalizer={name}: not a known normalizer; choose one of {', '.join(NORMALIZERS)}"
        ) from None
