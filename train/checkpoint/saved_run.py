"""A training run's saved checkpoint, as the tools that read one back find it: the checkpoint
(the newest complete one, a step, or a path) and the model it trained (a preset, or with a
pretrained LLM), from the checkpoint's own record. ``train.evaluate`` and ``train.export`` share
it, so both rebuild exactly what was trained.
"""

from __future__ import annotations

from pathlib import Path

from contract.run_dir import CHECKPOINTS_DIR, MARKER, step_name
from train.checkpoint.location import Ref, completed, is_complete, read_state, recorded
from train.config import ConfigError, ModelConfig, model_from_record
from train.data.storage import is_url


def find_checkpoint(run_dir: Path, checkpoint: str | None, step: int | None) -> Ref:
    """``checkpoint`` (a path or an s3:// prefix), else ``run_dir``'s checkpoint of ``step``,
    else its newest complete one, wherever the run keeps them (``train.checkpoint.location``);
    a missing or torn one is one ConfigError line listing the complete ones."""
    where = recorded(run_dir) or run_dir / CHECKPOINTS_DIR
    if checkpoint:
        found: Ref = checkpoint if is_url(checkpoint) else Path(checkpoint)
        if is_complete(found):
            return found
    complete = {number: ref for number, (ref, _) in completed(run_dir).items()}
    if not checkpoint:
        if step is None:
            if not complete:
                raise ConfigError(
                    f"run_dir={run_dir}: no complete checkpoint in {where}; train first, or "
                    "pass checkpoint=PATH"
                )
            return complete[max(complete)]
        found = complete.get(step, f"{where}/{step_name(step)}")
        if step in complete:
            return found
    names = ", ".join(step_name(number) for number in complete)
    raise ConfigError(
        f"{found} is not a complete checkpoint (no {MARKER} marker); complete ones in "
        f"{where}: {names or 'none'}"
    )


def saved_state(checkpoint: Ref) -> dict:
    """The checkpoint's state file: its ``step``, ``world_size`` and ``trainer_state``."""
    return read_state(checkpoint)


def saved_model(checkpoint: Ref, state: dict) -> ModelConfig:
    """The model config the run trained, as its checkpoint recorded it."""
    trainer_state = state.get("trainer_state", {})
    if "model" in trainer_state:
        return model_from_record(trainer_state["model"])
    if "model_preset" in trainer_state:  # saved before pretrained LLMs
        return ModelConfig(preset=trainer_state["model_preset"])
    raise ConfigError(f"{checkpoint} does not record its model (saved by an older trainer)")
