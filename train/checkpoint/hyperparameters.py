"""The optimizer's hyperparameters in a checkpoint once, not once per parameter.

DCP's flattened optimizer state (``flatten_optimizer_state_dict``, which lets each pipeline
stage save and load its own parameters' entries) repeats every param group's hyperparameters
under each parameter's name: ``param_groups.<name>.lr``, ``...betas`` and ten more for AdamW,
each a separate pickled item that DCP plans, gathers to rank 0, writes and reads back. In a LoRA
run they were 2,900 of a checkpoint's 3,900 items and most of a save's seconds. The trainer's
optimizer has one param group, so every parameter holds the same values: a checkpoint keeps
them once, as ``hyperparameters.<field>``, and a load hands each parameter's entries that one
copy. Optimizer states with differing groups (none the trainer makes) are saved per parameter,
as checkpoints before 2026-11-30 were, and those still load as they are.
"""

from __future__ import annotations

from typing import Any

GROUP = "param_groups."  # a flattened entry: param_groups.<parameter>.<field>
SHARED = "hyperparameters."  # a shared one: hyperparameters.<field>
PLAIN = (bool, int, float, str, tuple, list, type(None))  # values compared with ==


def _field(key: str) -> str:
    return key.rsplit(".", 1)[1]


def shared(optim_state: dict[str, Any]) -> dict[str, Any]:
    """``optim_state`` (flattened) with the per-parameter hyperparameters replaced by one copy
    of each field, when every parameter has the same plain values; else as it is."""
    values: dict[str, Any] = {}
    for key, value in optim_state.items():
        if not key.startswith(GROUP):
            continue
        field = _field(key)
        if not isinstance(value, PLAIN) or values.get(field, value) != value:
            return optim_state
        values[field] = value
    if not values:
        return optim_state
    kept = {key: value for key, value in optim_state.items() if not key.startswith(GROUP)}
    return {**kept, **{SHARED + field: value for field, value in values.items()}}


def saved_shared(saved_keys: set[str]) -> bool:
    """Whether a checkpoint with these keys (``optim.<key>``, ...) keeps its hyperparameters
    once."""
    return any(key.startswith("optim." + SHARED) for key in saved_keys)


def to_load(template: dict[str, Any]) -> dict[str, Any]:
    """What to ask of a checkpoint that keeps its hyperparameters once, for a flattened
    ``template`` (the optimizer's own state dict): its per-parameter entries as the shared
    fields (each holding the template's value until loaded)."""
    state = {key: value for key, value in template.items() if not key.startswith(GROUP)}
    for key, value in template.items():
        if key.startswith(GROUP):
            state[SHARED + _field(key)] = value
    return state


def expanded(loaded: dict[str, Any], template: dict[str, Any]) -> dict[str, Any]:
    """The optimizer state to set: ``loaded`` (from ``to_load``) with each of ``template``'s
    per-parameter hyperparameter entries given its shared field's loaded value."""
    state = {key: value for key, value in loaded.items() if not key.startswith(SHARED)}
    for key in template:
        if key.startswith(GROUP):
            state[key] = loaded[SHARED + _field(key)]
    return state
