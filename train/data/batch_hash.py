"""Batch fingerprints: TP, CP and PP peers must see byte-identical batches, and the trainer
can prove it (``BatchChecks``: at a job's first step, and every step's hash with
``debug.batch_hashes``).

The hash covers every tensor of a batch (name, dtype, shape and raw bytes, keys in sorted
order), so two ranks agree exactly when the model inputs agree. Non-tensor entries such as
cut ids are metadata and are left out.
"""

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from train.parallel.dims import DENSE_DIMS, ParallelDims


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


def check_identical_batches(digest: str, dp_rank: int) -> None:
    """Ranks of one data-parallel coordinate (TP and PP peers) must hold byte-identical batches
    (same data-parallel rank, same seed). One all-gather over the world, at a job's first step."""
    gathered: list[tuple[int, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (dp_rank, digest))
    by_dp_rank: dict[int, dict[int, str]] = {}
    for rank, (peer_dp_rank, peer_digest) in enumerate(gathered):
        by_dp_rank.setdefault(peer_dp_rank, {})[rank] = peer_digest
    for peer_dp_rank, digests in by_dp_rank.items():
        if len(set(digests.values())) != 1:
            raise RuntimeError(
                f"ranks {sorted(digests)} share data-parallel rank {peer_dp_rank} but read "
                f"different first batches ({digests}): the data seed contract is broken; TP and "
                "PP peers must read the same batches"
            )


def mesh_coordinates(dims: ParallelDims, rank: int) -> dict[str, int]:
    """Where ``rank`` sits: its place in each view's dimensions and its data-parallel slot."""
    coords = dims.coordinates(rank)
    return {name: getattr(coords, name) for name in (*DENSE_DIMS, "ep", "dp_rank")}


class BatchChecks:
    """What a training step checks of its batches before it runs: at the job's first step, that
    peers sharing a data-parallel coordinate hold the same batches (``debug.check_batches``,
    when the layout has TP, CP or PP peers); with ``debug.batch_hashes``, every step's hash in
    ``RUN_DIR/batch_hashes/rank<R>.jsonl``."""

    def __init__(
        self, run_dir: Path, dims: ParallelDims, rank: int, check_peers: bool, write: bool
    ) -> None:
        self.run_dir, self.rank, self.write = run_dir, rank, write
        self.check_peers = check_peers and (dims.tp_enabled or dims.pp_enabled or dims.cp_enabled)
        self.coords = mesh_coordinates(dims, rank)
        self.first = True

    def step(self, step: int, batches: Sequence[Mapping[str, object]]) -> None:
        """Check (collective at the job's first step) and record step ``step``'s batches."""
        check, self.first = self.first and self.check_peers, False
        if not (check or self.write):
            return
        digest = step_hash(batches)
        if check:
            check_identical_batches(digest, self.coords["dp_rank"])
        if self.write:
            append_batch_hash(
                self.run_dir, step=step, rank=self.rank, coords=self.coords, digest=digest
            )
