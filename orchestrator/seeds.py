"""The check of a user's ``--seed``; the seeds themselves are derived by ``contract.seeds``."""

from __future__ import annotations

from contract.job_env import SEED_LIMIT


def validate_base_seed(seed: int) -> None:
    from orchestrator.errors import UsageError

    if not 0 <= seed < SEED_LIMIT:
        raise UsageError(f"--seed {seed} is out of range: give an integer in [0, {SEED_LIMIT - 1}]")
