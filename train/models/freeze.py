"""Which parameters train: ``model.freeze`` and ``model.unfreeze``, regular expressions over the
parameter names of the whole model (as checkpoints and ``named_parameters`` of one process name
them, e.g. ``llm.layers.3.attn.wq.weight``).

A parameter is frozen when a ``freeze`` pattern matches its name and no ``unfreeze`` pattern
does; a pattern matches anywhere in the name (``re.search``: anchor it with ``^`` to mean the
start). Frozen parameters get no gradient and no optimizer state.

Torch-free: the layout check refuses a pattern that matches nothing (a typo would otherwise
train everything) before any process starts, from the model's inventory.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence


def _compiled(key: str, patterns: Sequence[str]) -> list[re.Pattern]:
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except re.error as error:
            raise ValueError(f"{key}: '{pattern}' is not a regular expression ({error})") from None
    return compiled


def frozen_names(names: Iterable[str], freeze: Sequence[str], unfreeze: Sequence[str]) -> set[str]:
    """The names among ``names`` that ``freeze`` and ``unfreeze`` leave frozen; each pattern
    must change something, and something must still train (one ValueError line otherwise)."""
    names = list(names)
    freezing, unfreezing = _compiled("model.freeze", freeze), _compiled("model.unfreeze", unfreeze)
    matched = {pattern: {n for n in names if pattern.search(n)} for pattern in freezing}
    for pattern, hits in matched.items():
        if not hits:
            raise ValueError(
                f"model.freeze: '{pattern.pattern}' matches no parameter; names look like "
                f"{names[len(names) // 2]!r}"
            )
    candidates = set().union(*matched.values())
    for pattern in unfreezing:
        if not any(pattern.search(n) for n in candidates):
            raise ValueError(
                f"model.unfreeze: '{pattern.pattern}' matches no frozen parameter; it would "
                "change nothing"
            )
    frozen = {n for n in candidates if not any(p.search(n) for p in unfreezing)}
    if frozen and len(frozen) == len(set(names)):
        raise ValueError("model.freeze freezes every parameter: nothing would train")
    return frozen
