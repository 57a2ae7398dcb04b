"""Batch fingerprints: TP and PP peers must see byte-identical batches, and the trainer can
prove it.

The hash covers every tensor of a batch (name, dtype, shape and raw bytes, keys in sorted
order), so two ranks agree exactly when the model inputs agree. Non-tensor entries such as
cut ids are metadata and are left out.
"""

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch


def batch_hash(batch: Mapping[str, object]) -> str:
    """sha256 hex digest over the batch's tensors in sorted key order."""
    digest = hashlib.sha256()
    for key in sorted(batch):
        value = batch[key]
        if not isinstance(value, torch.Tensor):
            continue
        tensor = value.detach().cpu().contiguous()
        digest.update(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def step_hash(batches: Sequence[Mapping[str, object]]) -> str:
    """The digest of one optimizer step's batches: the batch's own digest when there is one,
    else sha256 over the digests of each, in order (gradient accumulation)."""
    if len(batches) == 1:
        return batch_hash(batches[0])
    return hashlib.sha256("".join(batch_hash(b) for b in batches).encode()).hexdigest()


def batch_hash_record(step: int, rank: int, coords: Mapping[str, int], digest: str) -> str:
    """One JSON line: the step, the global rank, its named mesh coordinates and the hash."""
    return json.dumps({"step": step, "rank": rank, "coords": dict(coords), "hash": digest}) + "\n"


def append_batch_hash(
    run_dir: Path, *, step: int, rank: int, coords: Mapping[str, int], digest: str
) -> Path:
    """Append one record to ``run_dir/batch_hashes/rank{rank}.jsonl``; returns that path."""
    path = Path(run_dir) / "batch_hashes" / f"rank{rank}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(batch_hash_record(step, rank, coords, digest))
    return path
