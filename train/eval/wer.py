"""Word and character error rates of a whole corpus, in counts that shards add up exactly.

A corpus's WER is its total word edits over its total reference words (CER the same over
characters), not a mean of per-utterance rates: a mean gives a two-word utterance as much weight
as a fifty-word one. So scoring keeps the edit counts (``ErrorCounts``); ranks that each score a
shard sum theirs (``+``, or ``all_reduce`` of ``dataclasses.astuple(counts)`` rebuilt with
``ErrorCounts(*values)``) and read ``wer`` and ``cer`` from the sum, which equals scoring the
union of the shards. Alignments come from jiwer (Levenshtein over words, then over characters).

Both sides are normalized before scoring, by the normalizer the caller names
(``train.eval.normalizers``). An utterance whose reference is empty after normalization counts every
hypothesis word and character as an insertion; the rates of a corpus with no reference words at
all are undefined and raise ValueError.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import astuple, dataclass

import jiwer

from train.eval.normalizers import Normalizer


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
    wrong_utterances: int = 0  # with any word error: what the sentence error rate counts

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

    @property
    def ser(self) -> float:
        """The share of utterances with any word error (sentence error rate): one minus the
        share answered exactly, what a conversation's short answers are judged by."""
        return self.wrong_utterances / self.utterances if self.utterances else 0.0

    def figures(self) -> dict[str, float | int]:
        """What an evaluation reports of the set: WER, CER, and the word substitutions,
        deletions and insertions that make up the WER, as counts and as rates over the
        reference words (the three rates add up to the WER)."""
        edits = {
            "substitution": self.word_substitutions,
            "deletion": self.word_deletions,
            "insertion": self.word_insertions,
        }
        wer = self.wer  # raises where there are no reference words to divide by
        return {
            "wer": wer,
            "cer": self.cer,
            "ser": self.ser,
            **{f"{kind}s": count for kind, count in edits.items()},
            **{f"{kind}_rate": count / self.reference_words for kind, count in edits.items()},
            "reference_words": self.reference_words,
            "num_utterances": self.utterances,
        }


def error_rate(name: str, edits: int, reference: int, unit: str, utterances: int) -> float:
    """``edits / reference``; a ValueError when the references hold no ``unit`` to divide by."""
    if reference == 0:
        raise ValueError(
            f"{name} is undefined: the {utterances} reference(s) hold no {unit} after normalization"
        )
    return edits / reference


def score_pair(reference: str, hypothesis: str, normalize: Normalizer) -> ErrorCounts:
    """The edit counts of one utterance, both sides normalized first."""
    return edit_counts(normalize(reference), normalize(hypothesis))


def edit_counts(reference: str, hypothesis: str) -> ErrorCounts:
    """The edit counts of one utterance whose two sides are normalized already."""
    if not reference:  # jiwer 3 refuses empty references; every hypothesis token is inserted
        return ErrorCounts(
            utterances=1,
            word_insertions=len(hypothesis.split()),
            char_insertions=len(hypothesis),
            wrong_utterances=int(bool(hypothesis.split())),
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
        wrong_utterances=int(words.substitutions + words.deletions + words.insertions > 0),
    )


def score_corpus(pairs: Iterable[tuple[str, str]], normalize: Normalizer) -> ErrorCounts:
    """The summed edit counts of (reference, hypothesis) pairs, scored as one corpus."""
    total = ErrorCounts()
    for reference, hypothesis in pairs:
        total += score_pair(reference, hypothesis, normalize)
    return total
