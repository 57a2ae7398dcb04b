"""Job seeds for a chain, below contract.job_env.SEED_LIMIT.

A chain with ``--seed S`` is reproducible: job k's seed comes from a SeedSequence keyed on (S, k),
a collision-free derivation, never ``S + k`` arithmetic.
"""

from __future__ import annotations

import secrets

from contract.job_env import SEED_LIMIT


def validate_base_seed(seed: int) -> None:
    from orchestrator.errors import UsageError

    if not 0 <= seed < SEED_LIMIT:
        raise UsageError(f"--seed {seed} is out of range: give an integer in [0, {SEED_LIMIT - 1}]")


def chain_seeds(num_jobs: int, base_seed: int | None = None) -> list[int]:
    """One distinct seed per job: random when ``base_seed`` is None, else derived from it."""
    seeds: list[int] = []
    seen: set[int] = set()
    for index in range(num_jobs):
        attempt = 0
        while True:
            if base_seed is None:
                seed = secrets.randbelow(SEED_LIMIT)
            else:
                import numpy as np  # only reproducible chains pay for the import

                words = np.random.SeedSequence([base_seed, index, attempt]).generate_state(1)
                seed = int(words[0]) % SEED_LIMIT
            if seed not in seen:
                break
            attempt += 1
        seen.add(seed)
        seeds.append(seed)
    return seeds
