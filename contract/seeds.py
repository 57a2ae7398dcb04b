"""The one rule that derives job and sweep-member seeds, below ``job_env.SEED_LIMIT``.

A chain's job ``k`` and a sweep's member ``k`` take the ``k``-th seed of one sequence: random
when no base seed is given, else hashed from (base seed, k) so that ``--seed S`` reproduces the
chain, never ``S + k`` arithmetic. Standard library only: the submit path derives them without
numpy, and the trainer's Hydra resolver (``train.config.member_seed``) with the same function.
"""

from __future__ import annotations

import hashlib
import secrets

from contract.job_env import SEED_LIMIT


def derived_seed(base_seed: int, index: int, attempt: int = 0) -> int:
    """Seed ``index`` of the sequence from ``base_seed`` (``attempt``: the next try after a
    collision with an earlier index)."""
    digest = hashlib.blake2b(f"{base_seed}:{index}:{attempt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % SEED_LIMIT


def chain_seeds(num_jobs: int, base_seed: int | None = None) -> list[int]:
    """One distinct seed per job: random when ``base_seed`` is None, else derived from it (a
    longer chain from the same base seed starts with the same seeds)."""
    seeds: list[int] = []
    seen: set[int] = set()
    for index in range(num_jobs):
        attempt = 0
        while True:
            if base_seed is None:
                seed = secrets.randbelow(SEED_LIMIT)
            else:
                seed = derived_seed(base_seed, index, attempt)
            if seed not in seen:
                break
            attempt += 1
        seen.add(seed)
        seeds.append(seed)
    return seeds
