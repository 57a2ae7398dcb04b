"""The pretrained parts a model starts from, by their ``ModelConfig`` key: where a config says
they are, and which of the model's parameters each part's files hold.

A checkpoint holds the frozen parameters of a pretrained part by reference (the part's
directory and its files' digests, ``train.checkpoint.references``), so this is the one place
that says which parameter comes from which part: the LLM's under their Hugging Face names
(``train.models.hf_names``; LoRA adapters are ours), the encoder's under ``encoder.``. Torch-free:
the trainer's preflight and the planner read it.
"""

from __future__ import annotations

from pathlib import Path

from train.models.hf_names import hf_name
from train.models.lora import is_adapter

LLM_PART = "pretrained_llm"
ENCODER_PART = "pretrained_encoder"
# What a run starts from, by ModelConfig key: the part's name in the log.
PARTS = {LLM_PART: "LLM", ENCODER_PART: "encoder"}
ENCODER_PREFIX = "encoder."  # a pretrained encoder's parameters: this, then transformers' names


def pretrained_dirs(model: object) -> dict[str, str | None]:
    """``model``'s pretrained directories by key (a ``ModelConfig``, or the record a checkpoint
    keeps of it), absolute, so evaluation and export find them from any working directory
    (None: the preset's own part)."""
    dirs: dict[str, str | None] = {}
    for key in PARTS:
        directory = model.get(key) if isinstance(model, dict) else getattr(model, key)
        dirs[key] = None if directory is None else str(Path(directory).expanduser().resolve())
    return dirs


def part_of(name: str) -> str | None:
    """The part whose files hold parameter ``name`` (canonical, as a plain model names it) when
    that part is pretrained; None for the projector, LoRA adapters and what no family has."""
    if name.startswith(ENCODER_PREFIX):
        return ENCODER_PART
    if is_adapter(name):
        return None
    try:
        return LLM_PART if hf_name(name) is not None else None
    except KeyError:  # a preset's option no pretrained family has (experts, ...)
        return None


def referenced_names(frozen: set[str], pretrained: set[str]) -> set[str]:
    """The parameters among ``frozen`` that a checkpoint holds by reference: those of the
    ``pretrained`` parts (keys of ``PARTS``)."""
    return {name for name in frozen if part_of(name) in pretrained}
