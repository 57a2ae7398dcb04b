"""The seed contract inside a job: which randomness is shared by which ranks.

Every data seed is derived from the job seed through numpy's ``SeedSequence``, which hashes
its inputs, so no two (job seed, epoch, data-parallel rank, worker) tuples map onto one
another the way ``seed + 100000 * rank`` arithmetic does (job seed 100000 on rank 0 equals
job seed 0 on rank 1 there).

- Only the data-parallel coordinate enters a rank's data seed. Ranks that share it (TP/SP
  peers, and CP/PP peers when they exist) derive the same seed and read byte-identical batches.
- Every data-parallel rank derives a different seed and reads a different stream.
- A new job seed gives a new data order, so a resumed job never replays the previous order.
- The sampler seed depends on the job seed and the epoch only: lhotse's samplers shuffle one
  global order with it and hand every ``world_size``-th batch to each rank, so all
  data-parallel ranks must share it for their streams to be disjoint.
- A training rank's own generators (torch's CPU and CUDA, Python's, numpy's: dropout, and
  anything else the step draws) are seeded by ``seed_rank`` from the job seed, its
  data-parallel rank and its pipeline stage: data-parallel ranks draw differently, TP and CP
  peers, which hold the same activations, draw the same masks, and pipeline stages, which hold
  different layers, draw apart.

Derived seeds are below 2**31 so any consumer (numpy's legacy 2**32 limit, lhotse adding an
epoch or a worker offset) can use them without overflow.
"""

import random

import numpy as np
import torch

from contract.job_env import SEED_LIMIT

# First spawn-key element: keeps the seeds drawn for different purposes apart.
_PURPOSE_SAMPLER = 0
_PURPOSE_RANK_STREAM = 1
_PURPOSE_MIXTURE = 2
_PURPOSE_RANK_GENERATORS = 3


def _derive(job_seed: int, key: tuple[int, ...]) -> int:
    """Hash (job_seed, key) into one seed below 2**31."""
    if job_seed < 0 or min(key) < 0:
        raise ValueError(f"seeds are derived from non-negative integers, got {job_seed} and {key}")
    state = np.random.SeedSequence(entropy=job_seed, spawn_key=key).generate_state(1, np.uint32)
    return int(state[0]) % SEED_LIMIT


def sampler_seed(job_seed: int, epoch: int = 0) -> int:
    """Seed for the shuffle that all data-parallel ranks share (they then take disjoint batches)."""
    return _derive(job_seed, (_PURPOSE_SAMPLER, epoch))


def mixture_seed(job_seed: int, epoch: int = 0) -> int:
    """Seed of the source mixture in ``epoch`` (each source's shuffles and the draw between
    sources), shared by all data-parallel ranks like ``sampler_seed``."""
    return _derive(job_seed, (_PURPOSE_MIXTURE, epoch))


def rank_data_seed(job_seed: int, dp_rank: int, worker_id: int = 0, *, epoch: int = 0) -> int:
    """Seed of one DP rank's dataloader worker: equal for TP peers, distinct across DP ranks."""
    return _derive(job_seed, (_PURPOSE_RANK_STREAM, epoch, dp_rank, worker_id))


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's global generators with one value."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rank_generator_seed(job_seed: int, dp_rank: int, pp_rank: int) -> int:
    """Seed of a training rank's own generators: equal for TP and CP peers (same data-parallel
    rank and stage), distinct across data-parallel ranks and pipeline stages."""
    return _derive(job_seed, (_PURPOSE_RANK_GENERATORS, dp_rank, pp_rank))


def seed_rank(job_seed: int, dp_rank: int, pp_rank: int) -> int:
    """Seed this training rank's generators (torch's on every device, Python's, numpy's) from
    the job seed; the seed used."""
    seed = rank_generator_seed(job_seed, dp_rank, pp_rank)
    seed_everything(seed)
    return seed
