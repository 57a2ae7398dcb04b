"""A training run's saved checkpoint, as the tools that read one back find it: the checkpoint
(the newest complete one, a step, or a path) and the model it trained (a preset, or with a
pretrained LLM), from the checkpoint's own record. ``train.evaluate`` and ``train.export`` share
it, so both rebuild exactly what was trained.
"""

from __future__ import annotations

import json
from pathlib import Path

from contract.run_dir import CHECKPOINTS_DIR, MARKER, STATE_FILE, complete_checkpoints, step_name
from train.checkpoint.manager import CheckpointManager
from train.config import ConfigError, ModelConfig, model_from_record


def find_checkpoint(run_dir: Path, checkpoint: str | None, step: int | None) -> Path:
    """``checkpoint`` (a path), else ``run_dir``'s checkpoint of ``step``, else its newest
    complete one; a missing or torn one is one ConfigError line listing the complete ones."""
    if checkpoint:
        path = Path(checkpoint)
    elif step is not None:
        path = run_dir / CHECKPOINTS_DIR / step_name(step)
    else:
        latest = CheckpointManager(run_dir).latest() if run_dir.is_dir() else None
        if latest is None:
            raise ConfigError(
                f"run_dir={run_dir}: no complete checkpoint in {run_dir / CHECKPOINTS_DIR}; "
                "train first, or pass checkpoint=PATH"
            )
        return latest
    if not (path / MARKER).is_file():
        complete = ", ".join(p.name for p in complete_checkpoints(run_dir).values())
        raise ConfigError(
            f"{path} is not a complete checkpoint (no {MARKER} marker); complete ones in "
            f"{run_dir / CHECKPOINTS_DIR}: {complete or 'none'}"
        )
    return path


def saved_state(checkpoint: Path) -> dict:
    """The checkpoint's state file: its ``step``, ``world_size`` and ``trainer_state``."""
    return json.loads((checkpoint / STATE_FILE).read_text())


def saved_model(checkpoint: Path, state: dict) -> ModelConfig:
    """The model config the run trained, as its checkpoint recorded it."""
    trainer_state = state.get("trainer_state", {})
    if "model" in trainer_state:
        return model_from_record(trainer_state["model"])
    if "model_preset" in trainer_state:  # saved before pretrained LLMs
        return ModelConfig(preset=trainer_state["model_preset"])
    raise ConfigError(f"{checkpoint} does not record its model (saved by an older trainer)")
