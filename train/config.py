"""The training configuration: structured dataclasses that Hydra fills from YAML and overrides.

The schema is registered with Hydra's ConfigStore as ``trainer_schema``; recipe configs in
``recipes/conf/`` list it first in their defaults, so a misspelt key or a wrong type is an error
before anything starts. ``validate`` checks what types cannot, in one clear line per problem.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException, MissingConfigException, OverrideParseException
from hydra.types import RunMode
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from contract.job_end import EXIT_CONFIG
from contract.job_env import SEED_LIMIT
from contract.seeds import chain_seeds
from contract.spelling import closest
from train.checkpoint.location import check_location as check_checkpoint_location
from train.data.sources import Source, read_sources
from train.loop.host_syncs import HOST_SYNC_MODES
from train.loop.watchdog import STOPPABLE
from train.models.lora import DEFAULT_ALPHA, DEFAULT_TARGETS
from train.parallel.dims import AC_MODES, DEFAULT_LOSS_CHUNK, STRATEGIES, Degrees

# data.on_layout_change: what a resume does when the data layout its position was saved under
# changed (train/data/layout.py).
REFUSE, RESTART_EPOCH, CONTINUE = "refuse", "restart_epoch", "continue"
ON_LAYOUT_CHANGE = (REFUSE, RESTART_EPOCH, CONTINUE)
# data.balance: how a step's examples are dealt to the data-parallel ranks (train/data/balance.py).
BALANCE_FLOPS, BALANCE_SECONDS, BALANCE_AUTO = "flops", "seconds", "auto"
BALANCE_MODES = (BALANCE_AUTO, BALANCE_FLOPS, BALANCE_SECONDS)
DEFAULT_RUN_DIR = "runs/local"  # a single run's, under the directory it starts in
BUFFER_SIZE = 20_000  # data.buffer_size's default: lhotse's own
# The base seed of a multirun whose launcher gives none (hydra-submitit-launcher): member k takes
# the k-th seed that ``contract.seeds`` derives from it, by the chains' own rule.
MEMBER_SEED_ROOT = 20_261_122


@dataclass
class ParallelConfig(Degrees):
    """The degrees (``train.parallel.dims.Degrees``) and how the pipeline runs."""

    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b (train/parallel/pipeline_plan.py)
    pp_microbatches: int = 0  # per batch; 0: 2 * pp
    pp_stages_per_rank: int = 0  # virtual stages; 0: 2 for interleaved_1f1b, else 1
    pp_split: list[int] = field(default_factory=list)  # LLM blocks per stage; []: balanced


@dataclass
class LoraConfig:
    """LoRA adapters on the LLM's projections (train/models/lora.py, through peft)."""

    rank: int = 0  # 0: no adapters
    alpha: float = DEFAULT_ALPHA  # the update is scaled by alpha / rank
    dropout: float = 0.0  # on the adapters' input
    # Hugging Face projection names (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj),
    # the same for a preset's decoder (Llama's blocks).
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))


@dataclass
class ModelConfig:
    preset: str = "tiny"  # a name in train/models/presets.py: tiny, small, llm_1b, llama_8b, ...
    init_seed: int = 1234  # the same on every rank, so replicated parameters start identical
    # A local Hugging Face decoder directory (Llama, Qwen2, Qwen3): its shape replaces the
    # preset's LLM and its weights are loaded at the first job (train/models/hf_weights.py).
    pretrained_llm: str | None = None
    # With a pretrained LLM, examples follow its chat template (train/data/prompt.py): the user's
    # instruction before the audio (None: train.data.prompt.DEFAULT_PROMPT) and a system text.
    prompt: str | None = None
    system: str | None = None
    # Regular expressions over parameter names (train/models/freeze.py): matched by a freeze
    # pattern and by no unfreeze pattern, a parameter gets no gradient and no optimizer state.
    freeze: list[str] = field(default_factory=list)
    unfreeze: list[str] = field(default_factory=list)
    # With lora.rank > 0 the LLM's own weights are frozen and only its adapters (and the
    # encoder and projector, unless frozen) train; model.unfreeze can release LLM weights.
    lora: LoraConfig = field(default_factory=LoraConfig)
    # A local Hugging Face audio encoder directory (Whisper, Parakeet; its feature extractor's
    # preprocessor_config.json beside it): it replaces the preset's own encoder, its weights are
    # loaded at the first job and its extractor computes the features (train/data/features.py).
    pretrained_encoder: str | None = None
    # Encoder frames stacked into one LLM audio position by the projector (its subsampling).
    projector_stride: int = 1


def model_from_record(record: dict) -> ModelConfig:
    """A ``model`` config as a checkpoint or an export records it (JSON); one saved before
    LoRA has no ``lora`` (none)."""
    return ModelConfig(**{**record, "lora": LoraConfig(**record.get("lora", {}))})


@dataclass
class DataConfig:
    corpus: str = "data/corpus"  # made by recipes/make_corpus.py
    split: str = "train"  # reads cuts_<split>.jsonl.gz, or shar/<split> with shar=true
    shar: bool = False
    max_duration: float = 20.0  # seconds of audio per batch per data-parallel rank
    buckets: int = 4
    # Cuts the bucketing sampler reads ahead to fill its buckets (lhotse's buffer_size, NeMo's
    # bucket_buffer_size): more mix batches better, fewer start sooner. An endless mixture
    # (data.input_cfg) fills it before the first batch: from object storage, with the audio.
    buffer_size: int = BUFFER_SIZE
    num_workers: int = 1
    # Training sources (train/data/sources.py): a YAML file of them or an inline list; lhotse cut
    # manifests, Shar directories or recordings + supervisions pairs, with weights, names and
    # tags, nested in groups; or NeMo's input_cfg entries as they are
    # (train/data/nemo_input_cfg.py). When set it replaces corpus/split/shar as the training data.
    input_cfg: Any = None
    # A directory where features computed from audio are kept (train/data/features.py), so that
    # later epochs and jobs read them instead of computing them again; None: compute each time.
    feature_cache: str | None = None
    # A job resumed with the same seed whose data layout (data-parallel size, sources, weights,
    # max_duration, buckets, buffer_size, Shar workers) differs from its checkpoint's: refuse,
    # restart_epoch or continue (train/data/layout.py).
    on_layout_change: str = REFUSE
    # How a step's examples are dealt to the data-parallel ranks (train/data/balance.py): flops
    # (each example's training FLOPs at the model's shape, so no rank waits long for another),
    # seconds (lhotse's sampler as it is: seconds of audio), or auto: flops, but seconds for
    # Shar (whose ranks draw streams of their own).
    balance: str = BALANCE_AUTO
    # Steps whose examples are dealt together under flops: more even work per rank, but the
    # sampler's duration buckets mixed, so more padding (docs/performance.md).
    balance_window: int = 1


@dataclass
class OptimConfig:
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 turns clipping off


@dataclass
class StragglerConfig:
    """Naming a slow rank (train/loop/straggler.py): the slowest in each of ``intervals``
    intervals of ``every`` steps in a row (0: never named; the per-rank figures are logged all
    the same), its compute time over them at least ``ratio`` times the other ranks' median."""

    ratio: float = 1.5
    intervals: int = 3
    every: int = 20


@dataclass
class TrainLoopConfig:
    max_steps: int = 100
    log_every: int = 1
    max_time_per_run: float = 0.0  # seconds this job may train before it saves and exits; 0: none
    max_steps_per_run: int = 0  # steps this job may train before it saves and exits; 0: none
    sync_every: int = 10  # steps between host syncs (stop agreement, non-finite check), and logs
    grad_accum: int = 1  # batches (microbatches) per optimizer step, gradients accumulated
    nonfinite_limit: int = 5  # consecutive non-finite steps (skipped) that end the job, exit 3
    # seconds a rank may make no progress (a step, a save, a validation) before it ends the job
    # with exit 5 (train/loop/watchdog.py); also sets the process groups' timeout; 0: off
    hang_timeout_s: float = 300.0
    # MiB of device memory per rank for a frozen encoder's outputs, kept per utterance so that
    # each is encoded once a job (train/models/encoder_cache.py); 0: encode every batch
    encoder_cache_mb: int = 0
    # steps between Python's collections of reference cycles, on every rank at the same step
    # (train/loop/garbage.py); 0: Python's automatic collection
    gc_interval: int = 50
    straggler: StragglerConfig = field(default_factory=StragglerConfig)


@dataclass
class CheckpointConfig:
    interval: int = 50  # steps between checkpoints (and one at the end or on a stop signal)
    keep: int = 3
    # YAML key checkpoint.async_save (`async` is a Python keyword): write in the background
    # (DCP async_save) so training goes on; finalized at a later sync step, next save or the end.
    async_save: bool = False
    # Frozen parameters of a pretrained LLM or encoder are not saved: a checkpoint records the
    # part's directory and its files' digests, and a resume loads them from there (the files
    # must stay as they were). False: every checkpoint holds the whole model.
    by_reference: bool = True
    # Where checkpoints are saved: empty for RUN_DIR/checkpoints, or s3://bucket/prefix (each
    # run dir under a prefix of its own; credentials from the environment, as for data).
    location: str = ""


@dataclass
class EvalConfig:
    """Validation in the training loop (train/eval/validation.py)."""

    interval: int = 0  # steps between validation passes, plus one as each job ends; 0: off
    split: str = "dev"  # the loss over all of data.corpus's cuts_<split>.jsonl.gz
    max_duration: float = 0.0  # seconds of audio per validation batch and rank; 0: data's
    # Validation sets: a source file like data.input_cfg's, or an inline list of sources
    # (weights are ignored); each set's loss is logged as val_loss/<name> and their pooled loss
    # as val_loss. Empty: eval.split of data.corpus.
    sets: Any = field(default_factory=list)


@dataclass
class WandbConfig:
    enabled: bool = True
    project: str = "speechlm"
    mode: str | None = None  # None: online with WANDB_API_KEY, else offline (or WANDB_MODE)


@dataclass
class DebugConfig:
    batch_hashes: bool = False  # write batch_hashes/rank{R}.jsonl: one hash of each step's batch
    check_batches: bool = True  # stop if TP/PP peers do not hold the same first batch
    # Fault injection for tests: at these steps rank 0 poisons a gradient with NaN.
    inject_nonfinite_steps: list[int] = field(default_factory=list)
    # ... and at these steps, after the update, rank 0 fills a parameter with inf (as an
    # overflowing update would): the checkpoint guard must refuse to save it.
    inject_nonfinite_params: list[int] = field(default_factory=list)
    # ... and rank ``stop_rank`` stops itself (SIGSTOP, as a frozen node would) as it begins its
    # first ``stop_in`` ("save" or "validation"; "": never): a rank hung inside a phase the hang
    # watchdog watches besides steps (tests/test_hang.py).
    stop_in: str = ""
    stop_rank: int = 0
    # On CUDA, each training step after the job's first ``host_sync_warmup`` runs under
    # torch.cuda.set_sync_debug_mode: "warn" names every host sync, "error" raises at the first
    # (bench/gpu_check.py); "off": never. Logging, saving and validation steps stay outside.
    host_syncs: str = "off"
    host_sync_warmup: int = 2
    # The training step, its read-back and validation's forwards with tensor factories defaulting
    # to the meta device: a tensor made without device= fails on the CPU as it would on a GPU
    # (train/loop/device_trap.py; the CPU suite's layouts run under it).
    device_trap: bool = False
    # torch.use_deterministic_algorithms: kernels that give the same bits on every run (CUDA's
    # atomics-based reductions replaced), so that a resumed chain can be compared bitwise.
    deterministic: bool = False


@dataclass
class TrainConfig:
    seed: int = 0  # the job seed; recipes pass the chain's $1
    run_dir: str = DEFAULT_RUN_DIR  # recipes pass $ORCH_RUN_DIR, shared by every job of a chain
    strategy: str = "fsdp2"
    compile: bool = False  # torch.compile each block, fullgraph (an MoE block around its dispatch)
    # What compiles the graphs: inductor generates kernels; aot_eager runs dynamo's guards and
    # AOT autograd without code generation (to tell a numerics problem from a tracing one).
    compile_backend: str = "inductor"
    activation_checkpointing: str = "none"  # none | full | selective (keep matmul outputs)
    # Positions whose fp32 logits the loss holds at once (train/models/head_loss.py): 1,024
    # at vocabulary 128K is 0.5 GiB, and the same again for their gradient.
    loss_chunk: int = DEFAULT_LOSS_CHUNK
    mixed_precision: bool = True  # bf16 on CUDA: FSDP2 params / fp32 reduce, or ddp autocast
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)


def member_seed() -> int:
    """The default job seed: 0 for a single run; in a Hydra multirun, one of its own per member.

    Chains override it with their job seed (``seed=${SEED}``); a sweep may set it explicitly.
    """
    if not HydraConfig.initialized():  # composed outside a Hydra run, e.g. to validate a member
        return 0
    config = HydraConfig.get()
    if config.mode != RunMode.MULTIRUN:
        return 0
    num = int(config.job.num)
    return chain_seeds(num + 1, MEMBER_SEED_ROOT)[num]


def default_run_dir() -> str:
    """The default run dir: a multirun member's sweep subdir (Hydra's output dir there), else
    ``DEFAULT_RUN_DIR``. A single run's Hydra output dir is ``.`` (the configs' ``hydra.run.dir``),
    not the default run dir: Hydra creates its output dir wherever the run starts, which left an
    empty ``runs/local`` behind a run told to train elsewhere."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return DEFAULT_RUN_DIR
    return str(HydraConfig.get().runtime.output_dir)


def register() -> None:
    """The schema for the configs' defaults lists, and the ``member_seed`` resolver they use."""
    ConfigStore.instance().store(name="trainer_schema", node=TrainConfig)
    OmegaConf.register_new_resolver("member_seed", member_seed, replace=True)
    OmegaConf.register_new_resolver("default_run_dir", default_run_dir, replace=True)


def data_path(cfg: TrainConfig) -> Path:
    corpus = Path(cfg.data.corpus)
    if cfg.data.shar:
        return corpus / "shar" / cfg.data.split
    return corpus / f"cuts_{cfg.data.split}.jsonl.gz"


def validation_path(cfg: TrainConfig) -> Path:
    return Path(cfg.data.corpus) / f"cuts_{cfg.eval.split}.jsonl.gz"


def validate(cfg: TrainConfig) -> None:
    """Checks no type can express; each failure is one ValueError line naming the key."""
    if cfg.strategy not in STRATEGIES:
        raise ValueError(f"strategy={cfg.strategy}: choose one of {', '.join(STRATEGIES)}")
    if cfg.activation_checkpointing not in AC_MODES:
        raise ValueError(
            f"activation_checkpointing={cfg.activation_checkpointing}: choose one of "
            f"{', '.join(AC_MODES)}"
        )
    if cfg.loss_chunk < 1:
        raise ValueError(f"loss_chunk={cfg.loss_chunk}: must be at least 1 (positions per chunk)")
    if not 0 <= cfg.seed < SEED_LIMIT:
        raise ValueError(f"seed={cfg.seed}: give an integer in [0, 2**31)")
    if cfg.train.max_steps < 1:
        raise ValueError(f"train.max_steps={cfg.train.max_steps}: must be at least 1")
    if cfg.checkpoint.interval < 1 or cfg.checkpoint.keep < 1:
        raise ValueError("checkpoint.interval and checkpoint.keep must be at least 1")
    if cfg.data.max_duration <= 0:
        raise ValueError(f"data.max_duration={cfg.data.max_duration}: must be positive")
    if cfg.data.buffer_size < 1:
        raise ValueError(f"data.buffer_size={cfg.data.buffer_size}: must be at least 1")
    if cfg.data.on_layout_change not in ON_LAYOUT_CHANGE:
        raise ValueError(
            f"data.on_layout_change={cfg.data.on_layout_change}: choose one of "
            f"{', '.join(ON_LAYOUT_CHANGE)}"
        )
    if cfg.data.balance not in BALANCE_MODES:
        raise ValueError(
            f"data.balance={cfg.data.balance}: choose one of {', '.join(BALANCE_MODES)}"
        )
    if cfg.data.balance_window < 1:
        raise ValueError(
            f"data.balance_window={cfg.data.balance_window}: must be at least 1 (steps)"
        )
    if cfg.data.balance == BALANCE_FLOPS and reads_own_streams(cfg):
        raise ValueError(
            "data.balance=flops deals the examples every rank draws, but with data.shar each "
            "rank draws a stream of its own: set data.balance=seconds (or auto)"
        )
    if cfg.optim.lr <= 0:
        raise ValueError(f"optim.lr={cfg.optim.lr}: must be positive")
    if cfg.train.max_time_per_run < 0:
        raise ValueError("train.max_time_per_run must be 0 (no budget) or positive seconds")
    if cfg.train.sync_every < 1 or cfg.train.nonfinite_limit < 1:
        raise ValueError("train.sync_every and train.nonfinite_limit must be at least 1")
    if cfg.train.grad_accum < 1:
        raise ValueError(f"train.grad_accum={cfg.train.grad_accum}: must be at least 1")
    if cfg.train.encoder_cache_mb < 0:
        raise ValueError("train.encoder_cache_mb must be 0 (no cache) or positive MiB")
    if cfg.train.gc_interval < 0:
        raise ValueError(
            f"train.gc_interval={cfg.train.gc_interval}: must be 0 (Python's automatic "
            "collection) or a positive number of steps"
        )
    if cfg.train.hang_timeout_s < 0:
        raise ValueError("train.hang_timeout_s must be 0 (no watchdog) or positive seconds")
    straggler = cfg.train.straggler
    if straggler.ratio <= 1:
        raise ValueError(
            f"train.straggler.ratio={straggler.ratio}: must be above 1 (a rank this many times "
            "slower than the others' median is named)"
        )
    if straggler.every < 1:
        raise ValueError(
            f"train.straggler.every={straggler.every}: must be at least 1 step an interval"
        )
    if straggler.intervals < 0:
        raise ValueError(
            f"train.straggler.intervals={straggler.intervals}: must be 0 (never name a rank) or "
            "a positive number of log intervals in a row"
        )
    if cfg.debug.host_syncs not in HOST_SYNC_MODES:
        raise ValueError(
            f"debug.host_syncs={cfg.debug.host_syncs}: choose one of {', '.join(HOST_SYNC_MODES)}"
        )
    if cfg.debug.stop_in not in ("", *STOPPABLE):
        raise ValueError(f"debug.stop_in={cfg.debug.stop_in}: choose one of {', '.join(STOPPABLE)}")
    if cfg.model.pretrained_llm is None and (cfg.model.prompt, cfg.model.system) != (None, None):
        raise ValueError(
            "model.prompt and model.system shape a pretrained LLM's chat template: set "
            "model.pretrained_llm (the byte tokenizer of the presets has no prompt)"
        )
    if cfg.train.max_steps_per_run < 0:
        raise ValueError("train.max_steps_per_run must be 0 (no budget) or a positive step count")
    if cfg.eval.interval < 0 or cfg.eval.max_duration < 0:
        raise ValueError("eval.interval and eval.max_duration must be 0 (off / data's) or positive")
    if cfg.eval.interval and not cfg.eval.sets and not validation_path(cfg).exists():
        raise ValueError(
            f"eval.split={cfg.eval.split}: {validation_path(cfg)} does not exist; choose a split "
            "the corpus has (dev, test) or set eval.interval=0"
        )
    if cfg.model.projector_stride < 1:
        raise ValueError(f"model.projector_stride={cfg.model.projector_stride}: must be at least 1")
    if cfg.data.input_cfg is not None:
        if cfg.data.shar:
            raise ValueError(
                "data.shar reads the built-in corpus's Shar export; with data.input_cfg give "
                "Shar directories as `shar:` sources instead"
            )
        return
    path = data_path(cfg)
    if not path.exists():
        raise ValueError(
            f"data: {path} does not exist; make the corpus with "
            f"`python recipes/make_corpus.py --out {cfg.data.corpus}` (or `make corpus`)"
        )


def reads_own_streams(cfg: TrainConfig) -> bool:
    """Whether each data-parallel rank draws a stream of its own (the corpus's Shar export),
    rather than its share of the batches every rank draws."""
    return cfg.data.shar and cfg.data.input_cfg is None


def balance_mode(cfg: TrainConfig) -> str:
    """How this config's steps are dealt: flops or seconds (auto resolved)."""
    if cfg.data.balance != BALANCE_AUTO:
        return cfg.data.balance
    return BALANCE_SECONDS if reads_own_streams(cfg) else BALANCE_FLOPS


def check_data(cfg: TrainConfig) -> None:
    """``validate``, and every data source the config names found (local paths exist, object
    storage answers): torch-free, so that auto_launch's plan check refuses a missing corpus
    or source with the trainer's own line before anything is queued."""
    validate(cfg)
    if cfg.checkpoint.location:
        check_checkpoint_location(cfg.checkpoint.location)
    if cfg.data.input_cfg is not None:
        read_sources(cfg.data.input_cfg, "data.input_cfg")
    if cfg.eval.interval and cfg.eval.sets:
        eval_set_sources(cfg)


def eval_set_sources(cfg: TrainConfig) -> list[Source]:
    """The validation sources ``eval.sets`` names (a file, a mapping or a list), read and found."""
    sets = cfg.eval.sets
    return read_sources(sets if isinstance(sets, str | dict) else list(sets), "eval.sets")


class ConfigError(ValueError):
    """A bad config or layout, found before training starts: exit code 2."""


def composition_problem(error: Exception) -> str:
    """A config Hydra or OmegaConf could not compose, as one line: Hydra's words and the
    OmegaConf reason they wrap (Hydra prints them on lines of their own, with a hint to append
    the key with ``+``, which a schema's key never wants), and what a misspelt key or config
    name probably meant."""
    if isinstance(error, OverrideParseException):
        return f"{error.override}: {first_line(error)}"
    if isinstance(error, MissingConfigException) and error.options:
        group, _, name = (error.missing_cfg_file or "").rpartition("/")
        match = closest(name, error.options)
        hint = (
            f"did you mean {group}={match}?"
            if match
            else f"the options: {', '.join(error.options)}"
        )
        return f"{first_line(error)}; {hint}"
    if isinstance(error, OmegaConfBaseException):
        return f"{first_line(error)}{_key_hint(error)}"
    cause = error.__cause__
    if not isinstance(cause, OmegaConfBaseException):
        return first_line(error)
    return f"{first_line(error).rstrip('.')}: {first_line(cause)}{_key_hint(cause)}"


def first_line(error: BaseException) -> str:
    """An error's first line, else its type's name."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _key_hint(error: OmegaConfBaseException) -> str:
    """For a key the schema does not have, the key it most likely meant, else the keys there."""
    schema, key, full_key = error.object_type, error.key, error.full_key
    unknown_key = isinstance(error, (ConfigAttributeError, ConfigKeyError))
    if not (unknown_key and dataclasses.is_dataclass(schema) and isinstance(key, str)):
        return ""
    keys = [item.name for item in dataclasses.fields(schema)]
    parent = full_key[: -len(key)] if isinstance(full_key, str) and full_key.endswith(key) else ""
    match = closest(key, keys)
    if match:
        return f"; did you mean {parent}{match}?"
    return f"; the keys of {parent.rstrip('.') or 'the config'}: {', '.join(keys)}"


def refuse_uncomposable(main: Callable[[], None]) -> None:
    """Run a ``@hydra.main`` entrypoint, refusing a config Hydra cannot compose (a misspelt key,
    a value of the wrong type, an unknown config) as every bad config is refused: one ``error:``
    line, exit 2, where Hydra's own report is several lines and exit 1. Hydra lets its errors
    through only under HYDRA_FULL_ERROR, so this sets it: any other error then shows its whole
    traceback (exit 1). Every rank says it: a peer's exit may end rank 0 before it could."""
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        main()
    except CompactHydraException as error:
        print(f"error: {composition_problem(error)}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG)
