"""Text normalizers: ``basic`` as scoring always did, ``whisper_en`` as published English WERs
normalize, ``none`` as decoded, and a clear refusal of an unknown name."""

import pytest

from train.eval.normalizers import NORMALIZERS, basic, normalizer


@pytest.mark.parametrize(
    ("text", "normalized"),
    [
        ("The Cat SAT", "the cat sat"),
        ("Hello, world! (Really?)", "hello world really"),
        ("  spaced \t out\nwords  ", "spaced out words"),
        ("well-known end.Next", "well known end next"),
        ("Don't say 'no' to o'clock", "don't say no to o'clock"),
        ("don\u2019t \u2018quote\u2019", "don't quote"),
        ("trailing' 'leading ''", "trailing leading"),
        ("\uff21\uff22\uff23 \ufb01ne", "abc fine"),  # NFKC: fullwidth letters, the fi ligature
        # Symbols are not punctuation; nothing language-specific (no ß -> ss).
        ("Stra\u00dfe caf\u00e9 $5 + 3", "stra\u00dfe caf\u00e9 $5 + 3"),
        ("?!...", ""),
    ],
)
def test_basic(text, normalized):
    assert basic(text) == normalized
    assert normalizer("basic") is basic


@pytest.mark.parametrize(
    ("text", "normalized"),
    [
        ("Mr. Smith", "mister smith"),
        ("The colour grey", "the color gray"),
        ("I've got twenty five apples.", "i have got 25 apples"),
        ("[noise] uh, hello   there", "hello there"),
    ],
)
def test_whisper_en_spells_as_published_english_wers_do(text, normalized):
    """What a user comparing with a leaderboard's WER needs: abbreviations, British spelling,
    numbers and hesitations the way Whisper's normalizer writes them."""
    assert normalizer("whisper_en")(text) == normalized


def test_none_keeps_casing_and_punctuation():
    assert normalizer("none")("  Hello,  World!\n") == "Hello, World!"


def test_an_unknown_name_is_one_line_naming_the_choices():
    with pytest.raises(ValueError, match="normalizer=whisper: not a known normalizer") as refused:
        normalizer("whisper")
    message = str(refused.value)
    assert "\n" not in message and all(name in message for name in NORMALIZERS)
