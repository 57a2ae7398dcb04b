"""Each rank's generator states (torch CPU and CUDA, numpy, Python), in ``rng/rank_<r>.pt`` of a
checkpoint.

RNG states are per rank and meaningless under another world size (rank r then plays another
part), so each rank writes its own file and, on load, restores its own only when the world size
is unchanged; otherwise nothing is restored and rank 0 says so once. Of CUDA only the current
device's generator is saved: reading every visible device would create a context on each.
"""

from __future__ import annotations

import io
import logging
import random
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from train.checkpoint.collectives import global_rank, world_size

if TYPE_CHECKING:
    from train.checkpoint.places import Place, Ref

log = logging.getLogger(__name__)

RNG_DIR = "rng"


def rng_name(rank: int) -> str:
    """Rank ``rank``'s RNG file in a checkpoint."""
    return f"{RNG_DIR}/rank_{rank:05d}.pt"


def rng_state() -> dict[str, Any]:
    """This process's generator states, in types ``torch.load(weights_only=True)`` accepts."""
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": "MT19937",
            "state": {"key": np_state["key"].numpy().astype(np.uint32), "pos": np_state["pos"]},
            "has_gauss": np_state["has_gauss"],
            "gauss": np_state["gauss"],
        }
    )
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def rng_bytes(state: dict[str, Any]) -> bytes:
    """The RNG file's bytes (``torch.save``): the checkpoint's place writes them durably."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def restore_rng(place: Place, path: Ref, saved_world_size: int) -> str | None:
    """Restore this rank's RNG states from checkpoint ``path`` in ``place`` (same world size
    only); a problem, or None."""
    if saved_world_size != world_size():
        if global_rank() == 0:
            log.warning(
                "checkpoint %s was saved by %d ranks, this job has %d: RNG states not restored",
                path,
                saved_world_size,
                world_size(),
            )
        return None
    rng_file = rng_name(global_rank())
    try:
        state = torch.load(io.BytesIO(place.get(path, rng_file)), weights_only=True)
    except Exception as exc:  # torn pickles fail with any of several errors
        return f"cannot load checkpoint {path}: {path}/{rng_file}: {exc!r}"
    _set_rng_state(state)
    return None
