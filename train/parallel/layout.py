"""A training config's parallel layout: config -> ParallelDims -> checks -> pipeline plan.

Torch-free, so that everyone who must know the layout the trainer will run computes it with the
trainer's own code: the trainer and the evaluation, the submit path's plan check
(``orchestrator.planner.plan_check``, which prices exactly this split, padding and microbatch
count) and the Hydra launcher's members, all before any torch is loaded. Every failure is one
``ConfigError`` line naming the setting (exit 2 in the trainer).
"""

from __future__ import annotations

from pathlib import Path

from train.checkpoint.location import Ref, newest_state
from train.config import (
    REFUSE,
    ConfigError,
    LoraConfig,
    ModelConfig,
    TrainConfig,
    model_from_record,
    validate,
)
from train.data.layout import DATA_LAYOUT, data_layout, layout_changes, refusal
from train.models.freeze import frozen_names
from train.models.inventory import inventory
from train.models.lora import freeze_rules, with_lora
from train.models.presets import model_shape
from train.models.pretrained_parts import pretrained_dirs, referenced_names
from train.models.shape import SALMConfig
from train.parallel.dims import ParallelDims
from train.parallel.pipeline_plan import PipelinePlan, pipeline_plan


def model_of(model: ModelConfig) -> SALMConfig:
    """The shape of ``model`` (a preset, or its LLM a pretrained decoder's and its encoder a
    pretrained encoder's; with LoRA adapters when ``model.lora.rank`` asks for them)."""
    lora = model.lora
    try:
        shape = model_shape(
            model.preset, model.pretrained_llm, model.pretrained_encoder, model.projector_stride
        )
        return with_lora(shape, lora.rank, lora.alpha, lora.dropout, lora.target_modules)
    except ValueError as error:
        raise ConfigError(str(error)) from error


def checked_dims(
    world_size: int, degrees: object, model: SALMConfig, strategy: str
) -> ParallelDims:
    """The layout of ``degrees`` (any record of the six ``DEGREES``) on ``world_size`` ranks,
    checked against ``model``; a problem is one ConfigError line."""
    try:
        dims = ParallelDims.of(world_size, degrees)
        dims.validate(model, strategy)
    except (ValueError, KeyError) as error:
        raise ConfigError(str(error).strip("'\"")) from error
    return dims


def parallel_dims(cfg: TrainConfig, world_size: int) -> ParallelDims:
    """The config's layout on ``world_size`` ranks, checked against its model."""
    return checked_dims(world_size, cfg.parallel, model_of(cfg.model), cfg.strategy)


def pipeline_for(cfg: TrainConfig, dims: ParallelDims) -> PipelinePlan | None:
    """The pipeline plan of a layout with pp > 1 (None without pipeline parallelism)."""
    if not dims.pp_enabled:
        return None
    p = cfg.parallel
    try:
        return pipeline_plan(
            model_of(cfg.model),
            dims.pp,
            p.pp_schedule,
            p.pp_microbatches,
            p.pp_stages_per_rank,
            p.pp_split,
        )
    except ValueError as error:
        raise ConfigError(str(error)) from error


def frozen_of(cfg: TrainConfig) -> set[str]:
    """The parameter names ``model.freeze`` and ``model.unfreeze`` leave frozen, with the LLM's
    own weights under LoRA and a pretrained encoder's tensors that never train (whole-model
    names, from the inventory: every rank and the planner agree without building anything)."""
    tensors = inventory(model_of(cfg.model))
    freeze = freeze_rules(cfg.model.freeze, cfg.model.lora.rank)
    try:
        frozen = frozen_names([tensor.name for tensor in tensors], freeze, cfg.model.unfreeze)
    except ValueError as error:
        raise ConfigError(str(error)) from error
    return frozen | {tensor.name for tensor in tensors if not tensor.trainable}


def referenced_of(cfg: TrainConfig) -> set[str]:
    """The frozen parameters that checkpoints hold by reference (``checkpoint.by_reference``):
    those of a pretrained part the config names (``train.models.pretrained_parts``)."""
    if not cfg.checkpoint.by_reference:
        return set()
    parts = {part for part, path in pretrained_dirs(cfg.model).items() if path}
    return referenced_names(frozen_of(cfg), parts)


def check_encoder_cache(cfg: TrainConfig, dims: ParallelDims, frozen: set[str]) -> None:
    """``train.encoder_cache_mb`` keeps outputs that must never change: every encoder tensor
    frozen (``frozen``: ``frozen_of(cfg)``). And no pipeline: its schedule passes the first
    stage tensors only, no keys."""
    if not cfg.train.encoder_cache_mb:
        return
    if dims.pp_enabled:
        raise ConfigError(
            f"train.encoder_cache_mb={cfg.train.encoder_cache_mb}: the encoder cache is for "
            "layouts without pipeline parallelism; set parallel.pp=1 or train.encoder_cache_mb=0"
        )
    training = sorted(
        tensor.name
        for tensor in inventory(model_of(cfg.model))
        if tensor.name.startswith("encoder.") and tensor.name not in frozen
    )
    if training:
        raise ConfigError(
            f"train.encoder_cache_mb={cfg.train.encoder_cache_mb} keeps the outputs of a frozen "
            f"encoder, but {len(training)} encoder tensors train (e.g. {training[0]}): add "
            "'encoder\\..*' to model.freeze, or set train.encoder_cache_mb=0"
        )


def newest_trainer_state(cfg: TrainConfig) -> tuple[Ref, dict] | None:
    """The run dir's newest complete checkpoint and its trainer state (None: none, or one the
    loader will skip with its own warning)."""
    newest = newest_state(Path(cfg.run_dir))
    if newest is None:
        return None
    checkpoint, state = newest
    trainer_state = state.get("trainer_state")
    return (checkpoint, trainer_state) if isinstance(trainer_state, dict) else None


def check_adapters_kept(cfg: TrainConfig, newest: tuple[Ref, dict] | None) -> None:
    """A chain keeps its LoRA adapters: a config whose adapters (rank, targets) differ from
    those of the run dir's newest checkpoint would not find its parameters there. One line
    naming both, and what to do, before anything starts."""
    if newest is None or newest[1].get("model") is None:
        return
    checkpoint, state = newest
    saved = model_from_record(state["model"]).lora
    now = cfg.model.lora

    def adapters(lora: LoraConfig) -> str:
        return f"rank {lora.rank} on {','.join(lora.target_modules)}" if lora.rank else "none"

    if adapters(saved) != adapters(now):
        raise ConfigError(
            f"model.lora: {checkpoint} trained with adapters {adapters(saved)}, this config asks "
            f"for {adapters(now)}; a chain keeps its adapters: resume with the same model.lora, "
            "or export the run (python -m train.export) and start a new run_dir from it"
        )


def check_data_layout_kept(
    cfg: TrainConfig, dims: ParallelDims, newest: tuple[Ref, dict] | None
) -> None:
    """A job resumed with the same seed reads on from its checkpoint's data position, which
    holds only under the data layout it was saved with (train/data/layout.py): another one is
    refused in one line naming the changes, unless data.on_layout_change chooses otherwise."""
    if newest is None or cfg.data.on_layout_change != REFUSE:
        return
    checkpoint, state = newest
    saved = state.get(DATA_LAYOUT)
    if saved is None or (state.get("data_position") or {}).get("data_seed") != cfg.seed:
        return  # recorded before layouts were, or a new seed: a new order in any case
    try:
        changes = layout_changes(saved, data_layout(cfg, dims.dp))
    except ValueError as error:
        raise ConfigError(str(error)) from error
    if changes:
        raise ConfigError(refusal(str(checkpoint), changes))


def training_layout(cfg: TrainConfig, world_size: int) -> tuple[ParallelDims, PipelinePlan | None]:
    """The config checked, and the layout and pipeline plan it runs on ``world_size`` ranks."""
    try:
        validate(cfg)
    except ValueError as error:
        raise ConfigError(str(error)) from error
    dims = parallel_dims(cfg, world_size)
    check_encoder_cache(cfg, dims, frozen_of(cfg))
    newest = newest_trainer_state(cfg)
    check_adapters_kept(cfg, newest)
    check_data_layout_kept(cfg, dims, newest)
    return dims, pipeline_for(cfg, dims)
