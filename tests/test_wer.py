"""WER and CER scoring: hand-checked edit counts, normalization, corpus-level aggregation, and
the figures an evaluation summary reports."""

from dataclasses import astuple

import numpy as np
import pytest

from train.eval.normalizers import basic, collapse_whitespace
from train.eval.wer import ErrorCounts, score_corpus, score_pair


def word_edits(counts: ErrorCounts) -> tuple[int, int, int, int]:
    """(substitutions, deletions, insertions, reference words)."""
    return (
        counts.word_substitutions,
        counts.word_deletions,
        counts.word_insertions,
        counts.reference_words,
    )


@pytest.mark.parametrize(
    ("reference", "hypothesis", "edits", "wer"),
    [
        ("the cat sat", "the cat sat", (0, 0, 0, 3), 0.0),
        ("the cat sat", "the bat sat", (1, 0, 0, 3), 1 / 3),
        ("the cat sat", "the cat sat down", (0, 0, 1, 3), 1 / 3),
        ("the cat sat", "the sat", (0, 1, 0, 3), 1 / 3),
        # quick -> quack (S), fox deleted (D), today inserted (I); substituting word by word
        # instead would take 4 edits.
        ("the quick brown fox jumps high", "the quack brown jumps high today", (1, 1, 1, 6), 0.5),
        # the -> a and sat -> on (2 S), then the and mat inserted (2 I).
        ("the cat sat", "a cat on the mat", (2, 0, 2, 3), 4 / 3),
    ],
    ids=["exact", "substitution", "insertion", "deletion", "mixed", "mixed-more-words"],
)
def test_word_edits_are_counted(reference, hypothesis, edits, wer):
    counts = score_pair(reference, hypothesis, basic)
    assert word_edits(counts) == edits
    assert counts.utterances == 1
    assert counts.wer == pytest.approx(wer)


def test_casing_punctuation_and_spacing_are_not_errors():
    counts = score_pair("Don't stop, the train!", "  don't STOP the   train ", basic)
    assert word_edits(counts) == (0, 0, 0, 4)
    assert counts.cer == 0.0
    assert score_pair("dont stop", "don't stop", basic).word_substitutions == 1


def test_cer_on_a_hand_checked_pair():
    # "kitten sat" (10 characters, the space included) -> "sitting sat":
    # k->s and e->i are substitutions, the g is an insertion.
    counts = score_pair("kitten sat", "sitting sat", basic)
    chars = (
        counts.char_substitutions,
        counts.char_deletions,
        counts.char_insertions,
        counts.reference_chars,
    )
    assert chars == (2, 0, 1, 10)
    assert counts.cer == pytest.approx(3 / 10)
    assert counts.wer == pytest.approx(1 / 2)


def test_corpus_rate_is_total_edits_over_total_words_not_a_mean():
    pairs = [("hello", "yellow"), ("one two three four five six seven eight nine", "one two")]
    counts = score_corpus(pairs, basic)
    assert (counts.word_substitutions + counts.word_deletions, counts.reference_words) == (8, 10)
    assert counts.wer == pytest.approx(0.8)
    mean = sum(score_pair(r, h, basic).wer for r, h in pairs) / len(pairs)
    assert mean == pytest.approx((1 + 7 / 9) / 2)
    assert counts.wer != pytest.approx(mean)


def test_shards_combine_to_the_score_of_their_union():
    pairs = [
        ("the quick brown fox", "the quick brown fox"),
        ("jumps over", "jumped over the"),
        ("the lazy dog", "a lazy"),
        ("", "uh"),
        ("call one two", "call one two three"),
    ]
    left, right = score_corpus(pairs[:2], basic), score_corpus(pairs[2:], basic)
    union = score_corpus(pairs, basic)
    assert left + right == union
    assert sum([left, right], ErrorCounts()) == union
    # As ranks combine them: the counts as one vector each, summed element-wise (all_reduce).
    summed = np.add(astuple(left), astuple(right))
    assert ErrorCounts(*summed.tolist()) == union
    assert (left + right).wer == union.wer and (left + right).cer == union.cer
    assert union.utterances == 5


def test_an_empty_reference_counts_the_hypothesis_as_insertions():
    counts = score_pair("", "uh hm", basic)
    assert word_edits(counts) == (0, 0, 2, 0)
    assert (counts.char_insertions, counts.reference_chars) == (5, 0)
    assert word_edits(score_pair("...", "", basic)) == (0, 0, 0, 0)
    # In a corpus the insertions count against the other utterances' words.
    assert score_corpus([("", "uh hm"), ("yes please", "yes please")], basic).wer == pytest.approx(
        1.0
    )


def test_the_sentence_error_rate_counts_utterances_not_answered_exactly():
    """A conversation's one-word answers are judged right or wrong: an utterance with any word
    edit (an insertion after an empty reference too) is wrong, however many edits it has."""
    pairs = [("cats", "cats"), ("seven", "eleven"), ("the park", "park"), ("", ""), ("", "uh")]
    counts = score_corpus(pairs, basic)
    assert (counts.wrong_utterances, counts.utterances) == (3, 5)
    assert counts.ser == pytest.approx(0.6) and counts.figures()["ser"] == counts.ser
    halves = score_corpus(pairs[:2], basic) + score_corpus(pairs[2:], basic)
    assert halves.ser == counts.ser


def test_a_corpus_without_reference_words_has_no_rates():
    counts = score_corpus([("", "uh"), ("?!", "")], basic)
    with pytest.raises(ValueError, match="WER is undefined: the 2 reference"):
        _ = counts.wer
    with pytest.raises(ValueError, match="CER is undefined"):
        _ = counts.cer
    with pytest.raises(ValueError, match="WER is undefined: the 0 reference"):
        _ = score_corpus([], basic).wer


def test_the_normalizer_decides_what_counts_as_an_error():
    """The same transcript scores differently after each normalizer: why a summary names it."""
    from train.eval.normalizers import whisper_en

    reference, hypothesis = "Mr. Smith's colour", "mister smith's color"
    assert score_pair(reference, hypothesis, whisper_en).wer == 0.0
    assert word_edits(score_pair(reference, hypothesis, basic)) == (2, 0, 0, 3)
    assert word_edits(score_pair("Hello, World", "hello world", collapse_whitespace))[0] == 2


def test_figures_split_the_wer_into_its_edit_rates():
    counts = score_corpus(
        [("the quick brown fox jumps high", "the quack brown jumps high today"), ("a b", "a b")],
        basic,
    )
    figures = counts.figures()
    assert (figures["substitutions"], figures["deletions"], figures["insertions"]) == (1, 1, 1)
    assert (figures["reference_words"], figures["num_utterances"]) == (8, 2)
    rates = [figures[f"{kind}_rate"] for kind in ("substitution", "deletion", "insertion")]
    assert rates == [1 / 8] * 3 and sum(rates) == pytest.approx(figures["wer"])
    assert figures["cer"] == counts.cer
