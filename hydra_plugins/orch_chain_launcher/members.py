"""What both launchers do for each sweep member: its seed and run dir, and the trainer's checks.

Every member's config is built the way its job will build it and checked with the trainer's own
validation (train.config.validate and the parallel layout), so a sweep value that cannot run
stops the whole sweep before anything is submitted.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from omegaconf import DictConfig, OmegaConf, open_dict

from contract.seeds import chain_seeds
from orchestrator.errors import UsageError
from orchestrator.seeds import validate_base_seed


def override_value(overrides: Sequence[str], key: str) -> str | None:
    """The value of ``key=...`` (or ``+key``/``++key``) among Hydra overrides, else None."""
    for override in overrides:
        name, _, value = override.partition("=")
        if name.lstrip("+") == key:
            return value
    return None


def member_seeds(count: int, base_seed: int | None) -> list[int]:
    """Distinct seeds for members 0..count-1, derived from ``base_seed`` (contract.seeds)."""
    if base_seed is not None:
        validate_base_seed(base_seed)
    return chain_seeds(count, base_seed)


def with_run_dir_and_seed(
    job_overrides: Sequence[Sequence[str]],
    initial_job_idx: int,
    sweep_dir: Path,
    base_seed: int | None,
) -> list[list[str]]:
    """Each member's overrides plus ``run_dir=SWEEP_DIR/NUM`` and a seed of its own, unless the
    member sets them itself (``seed=1,2`` in the sweep wins)."""
    seeds = member_seeds(initial_job_idx + len(job_overrides), base_seed)[initial_job_idx:]
    members = []
    for offset, overrides in enumerate(job_overrides):
        member = list(overrides)
        if override_value(member, "run_dir") is None:
            member.append(f"run_dir={sweep_dir / str(initial_job_idx + offset)}")
        if override_value(member, "seed") is None:
            member.append(f"seed={seeds[offset]}")
        members.append(member)
    return members


def validate_members(
    hydra_context: Any,
    config: DictConfig,
    job_overrides: Sequence[Sequence[str]],
    initial_job_idx: int,
    world_size: int,
) -> list[Any]:
    """Build each member's trainer config and run the trainer's checks for ``world_size`` ranks;
    the configs (train.config.TrainConfig), in order."""
    from train.config import ConfigError, composition_problem
    from train.parallel.layout import training_layout

    configs = []
    for offset, overrides in enumerate(job_overrides):
        label = f"sweep member #{initial_job_idx + offset} ({' '.join(overrides)})"
        try:
            member = hydra_context.config_loader.load_sweep_config(config, list(overrides))
            with open_dict(member):
                del member["hydra"]
            cfg = OmegaConf.to_object(member)
            training_layout(cfg, world_size)
            configs.append(cfg)
        except (ValueError, ConfigError) as error:
            raise UsageError(f"{label}: {error} (on {world_size} rank(s))") from error
        except Exception as error:  # Hydra's and OmegaConf's own config errors
            raise UsageError(f"{label}: {composition_problem(error)}") from error
    return configs


def fail(error: UsageError) -> NoReturn:
    """The project's convention for bad input: one ``error:`` line and exit code 2."""
    print(f"error: {error}", file=sys.stderr, flush=True)
    sys.exit(UsageError.exit_code)


class ExitStatusAsResult:
    """Wraps the trainer's task function: its ``sys.exit(0)`` becomes a normal return.

    ``python -m train`` ends with ``sys.exit(code)``. Inside a submitit job that SystemExit would
    skip writing the job's result, and the waiting launcher would report the finished member as
    failed; a non-zero status becomes an exception Hydra records as the member's failure.
    """

    def __init__(self, task_function: Callable[[DictConfig], Any]) -> None:
        self.task_function = task_function

    def __call__(self, cfg: DictConfig) -> Any:
        try:
            return self.task_function(cfg)
        except SystemExit as exit_:
            if exit_.code in (0, None):
                return 0
            raise RuntimeError(f"the training exited with status {exit_.code}") from None
