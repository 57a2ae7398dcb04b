"""The one rule for the name a user probably meant by a misspelt one: a trainer override's key
(``train.max_step``), a recipe's field (``taks_per_node``). Both sides say "did you mean ..."
from it, so a typo gets the same suggestion wherever it is caught.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

CUTOFF = 0.6  # difflib's default similarity: close enough for typos, not for another word


def closest(word: str, names: Iterable[str]) -> str | None:
    """The name in ``names`` most like ``word``, or None when none is close enough."""
    matches = difflib.get_close_matches(word, list(names), n=1, cutoff=CUTOFF)
    return matches[0] if matches else None
