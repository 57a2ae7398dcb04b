"""The sizes of the corpora that the session's fixtures make (tests/conftest.py)."""

from __future__ import annotations

TINY_CORPUS = ("--num", "16", "--jobs", "2", "--shard-size", "4")  # 4-cut Shar shards
LIBRISPEECH_UTTERANCES = 20  # 12 train-clean-100, 4 dev-clean, 4 test-clean
