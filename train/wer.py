"""Word and character error rates of a whole corpus, in counts that shards add up exactly.

A corpus's WER is its total word edits over its total reference words (CER the same over
characters), not a mean of per-utterance rates: a mean gives a two-word utterance as much weight
as a fifty-word one. So scoring keeps the edit counts (``ErrorCounts``); ranks that each score a
shard sum theirs (``+``, or ``all_reduce`` of ``dataclasses.astuple(counts)`` rebuilt with
``ErrorCounts(*values)``) and read ``wer`` and ``cer`` from the sum, which equals scoring the
union of the shards. Alignments come from jiwer (Levenshtein over words, then over characters).

Both sides are normalized (``normalize``) before scoring. An utterance whose reference is empty
after normalization counts every hypothesis word and character as an insertion; the rates of a
corpus with no reference words at all are undefined and raise ValueError.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable
from dataclasses import astuple, dataclass

import jiwer

APOSTROPHES = ("'", "\u2019")  # ASCII and typographic; the latter is written as the former


@dataclass(frozen=True)
class ErrorCounts:
    """Edit counts of a set of utterances: the sufficient statistics of its WER and CER."""

    utterances: int = 0
    word_substitutions: int = 0
    word_deletions: int = 0
    word_insertions: int = 0
    reference_words: int = 0
    char_substitutions: int = 0
    char_deletions: int = 0
    char_insertions: int = 0
    reference_chars: int = 0

    def __add__(self, other: ErrorCounts) -> ErrorCounts:
        return ErrorCounts(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    @property
    def wer(self) -> float:
        """(substitutions + deletions + insertions) / reference words, over the whole set."""
        edits = self.word_substitutions + self.word_deletions + self.word_insertions
        return error_rate("WER", edits, self.reference_words, "words", self.utterances)

    @property
    def cer(self) -> float:
        """(substitutions + deletions + insertions) / reference characters (spaces between
        words included), over the whole set."""
        edits = self.char_substitutions + self.char_deletions + self.char_insertions
        return error_rate("CER", edits, self.reference_chars, "characters", self.utterances)


def error_rate(name: str, edits: int, reference: int, unit: str, utterances: int) -> float:
    """``edits / reference``; a ValueError when the references hold no ``unit`` to divide by."""
    if reference == 0:
        raise ValueError(
            f"{name} is undefined: the {utterances} reference(s) hold no {unit} after normalization"
        )
    return edits / reference


def normalize(text: str) -> str:
    """The text as it is scored: Unicode NFKC, lowercased, every punctuation character (Unicode
    category P*) replaced by a space except an apostrophe (' or U+2019, kept as ') between two
    letters or digits, as in "don't", then whitespace collapsed to single spaces and stripped.

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
    return " ".join("".join(kept).split())


def score_pair(reference: str, hypothesis: str) -> ErrorCounts:
    """The edit counts of one utterance, both sides normalized first."""
    reference, hypothesis = normalize(reference), normalize(hypothesis)
    if not reference:  # jiwer 3 refuses empty references; every hypothesis token is inserted
        return ErrorCounts(
            utterances=1, word_insertions=len(hypothesis.split()), char_insertions=len(hypothesis)
        )
    words = jiwer.process_words(reference, hypothesis)
    chars = jiwer.process_characters(reference, hypothesis)
    return ErrorCounts(
        utterances=1,
        word_substitutions=words.substitutions,
        word_deletions=words.deletions,
        word_insertions=words.insertions,
        reference_words=words.hits + words.substitutions + words.deletions,
        char_substitutions=chars.substitutions,
        char_deletions=chars.deletions,
        char_insertions=chars.insertions,
        reference_chars=chars.hits + chars.substitutions + chars.deletions,
    )


def score_corpus(pairs: Iterable[tuple[str, str]]) -> ErrorCounts:
    """The summed edit counts of (reference, hypothesis) pairs, scored as one corpus."""
    total = ErrorCounts()
    for reference, hypothesis in pairs:
        total += score_pair(reference, hypothesis)
    return total
