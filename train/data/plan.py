"""What a job reads, resolved and checked before any process group exists.

Training data is either the built-in corpus (``data.corpus``, ``data.split``, ``data.shar``:
the shorthand) or the sources of ``data.input_cfg`` (``train.data.sources``). Validation sets are
``eval.sets`` (each source its own set, its loss logged as ``val_loss/<name>``) or, without
them, ``eval.split`` of the corpus. Every source is walked once here (``check_sources``): a
source that cannot be used is one ``ConfigError`` line (exit 2), cuts no batch can use are set
aside with one line per source and reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lhotse.cut import Cut

from train.config import ConfigError, TrainConfig, eval_set_sources, validation_path
from train.data.features import AudioLimits, Extractor, Featurizer, extractor_of
from train.data.source_cuts import SourceCheck, check_sources, load_source_cuts
from train.data.sources import Source, SourceError, check_prompt_tags, read_sources
from train.parallel.layout import model_of


@dataclass
class ValidationCuts:
    name: str
    cuts: list[Cut]


@dataclass
class DataPlan:
    extractor: Extractor
    training: list[SourceCheck] | None  # None: the corpus shorthand (train.config.data_path)
    validation: list[ValidationCuts]

    @property
    def source_names(self) -> list[str]:
        return [check.source.name for check in self.training or []]


def data_plan(cfg: TrainConfig, say: Callable[[str], None]) -> DataPlan:
    """The job's training sources and validation sets, checked; problems are ConfigError."""
    try:
        extractor = extractor_of(cfg.model.pretrained_encoder)
        featurizer = Featurizer(extractor)
        shape = model_of(cfg.model)
        n_mels = shape.n_mels
        if featurizer.bins != n_mels:
            raise ConfigError(
                f"model.pretrained_encoder={cfg.model.pretrained_encoder}: its feature extractor "
                f"makes {featurizer.bins} bins per frame but the encoder takes {n_mels}; save the "
                "extractor that belongs to this encoder beside it"
            )
        limits = featurizer.limits(shape.enc_positions, shape.enc_subsampling)
        training = None
        if cfg.data.input_cfg is not None:
            sources = read_sources(cfg.data.input_cfg, "data.input_cfg")
            check_prompt_tags(sources, cfg.model.pretrained_llm, "data.input_cfg")
            training = check_sources(sources, cfg.data.max_duration, limits, say)
        validation = []
        if cfg.eval.interval:
            validation = validation_sets(cfg, limits, say)
        return DataPlan(extractor, training, validation)
    except (SourceError, ValueError) as error:
        raise ConfigError(str(error)) from error


def validation_sets(
    cfg: TrainConfig, limits: AudioLimits, say: Callable[[str], None]
) -> list[ValidationCuts]:
    if not cfg.eval.sets:
        source = Source(cfg.eval.split, "cuts", (validation_path(cfg),))
        return [ValidationCuts(cfg.eval.split, list(load_source_cuts(source)))]
    sources = eval_set_sources(cfg)
    check_prompt_tags(sources, cfg.model.pretrained_llm, "eval.sets")
    return [
        ValidationCuts(
            check.source.name,
            [cut for cut in load_source_cuts(check.source) if cut.id not in check.excluded],
        )
        for check in check_sources(sources, None, limits, say)
    ]
