"""The training loop every job of every chain runs.

Order of work: validate the config and the layout (before any process group), join the process
group, seed the rank's generators from the job seed (train/seeding.py), build the meshes, build
the model identically on every rank and parallelize it, restore the newest complete checkpoint of
the run dir (or start fresh), then train until ``max_steps``, a stop signal or the job's time
budget, saving at the checkpoint interval and on the way out.

The loop is torchtitan's shape: each component decides when it acts behind one call (the data
stream ``train.data.stream``, the step's tallies and read-back ``train.loop.step_tallies``, the
metrics line ``train.loop.step_log``, validation ``train.eval.validation.Validator``, checkpoints
``CheckpointManager.due``, the batch checks ``train.data.batch_hash.BatchChecks``, the hang
watchdog, the host-sync guard, the injected test faults ``train.loop.faults``), and ``TrainState``
is what the training has done, saved in every checkpoint. The job seed drives the data order and
every rank's own draws; a resumed job with the checkpoint's seed continues both, any other seed
starts new ones.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from contract import job_env
from contract.job_end import EXIT_HUNG, EXIT_NOT_SAVED, job_end_record, write_job_end
from train.checkpoint.location import LocationError, checkpoint_name, settle
from train.checkpoint.manager import CheckpointManager, CheckpointSaveError, NonFiniteState
from train.checkpoint.references import PretrainedPartChanged, check_newest
from train.config import ConfigError, TrainConfig
from train.data.batch_hash import BatchChecks
from train.data.features import Featurizer
from train.data.loader import LoadedBatch
from train.data.plan import DataPlan, data_plan
from train.data.storage import StorageError
from train.data.stream import TrainingData
from train.data.text import text_codec
from train.eval.validation import ValidationSet, Validator
from train.loop.device_trap import trapped
from train.loop.faults import InjectedFaults
from train.loop.garbage import Collector
from train.loop.host_syncs import HostSyncGuard
from train.loop.step import WholeModelRunner
from train.loop.step_log import StepLog, log_state_memory, write_job_start
from train.loop.step_tallies import COUNTS, StepTallies, Synced, global_counts
from train.loop.stop import StopRequest
from train.loop.straggler import StragglerWatch
from train.loop.train_state import TrainState
from train.loop.watchdog import RESTORE, SAVE, STEP, VALIDATION, Watchdog, process_group_timeout
from train.memory import gradient_bytes, state_bytes
from train.metrics import MetricsLogger
from train.models.batch import Batch
from train.models.build import build_model, build_pipeline, encoder_replica, freeze_parameters
from train.models.compiled import describe_graphs, graph_counts
from train.models.encoder_cache import MIB, EncoderCache
from train.models.hf_weights import PART_LOADERS
from train.models.parallelize import ParallelizeOptions, compute_autocast, fsdp_mixed_precision
from train.models.pipeline import PipelineRunner, merged_view
from train.models.pretrained_parts import PARTS, part_of, pretrained_dirs
from train.parallel.dims import ParallelDims
from train.parallel.distributed import clip_grad_norm, say
from train.parallel.layout import frozen_of, model_of, referenced_of, training_layout
from train.parallel.mesh import build_meshes
from train.parallel.pipeline_plan import PipelinePlan
from train.seeding import seed_rank


class TrainingDiverged(RuntimeError):
    """Too many consecutive non-finite steps: exit code 3, the last good checkpoint kept."""


@dataclass(frozen=True)
class Prepared:
    """What preflight resolved: the layout, the pipeline plan and the checked data."""

    dims: ParallelDims
    plan: PipelinePlan | None
    data: DataPlan
    checkpoints: str | None  # the run's prefix in object storage; None: RUN_DIR/checkpoints


def preflight(cfg: TrainConfig) -> Prepared:
    """Everything checkable before a process group exists: where checkpoints go, the layout,
    the compile backend, the pretrained parts the newest checkpoint holds by reference, and
    the data."""
    try:
        first_rank = os.environ.get("RANK", "0") == "0"
        checkpoints = settle(Path(cfg.run_dir), cfg.checkpoint.location, first_rank)
    except (LocationError, StorageError) as error:
        raise ConfigError(str(error)) from None
    dims, plan = training_layout(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    try:
        check_newest(Path(cfg.run_dir), pretrained_dirs(cfg.model))
    except (LocationError, PretrainedPartChanged, StorageError) as error:
        raise ConfigError(str(error)) from None
    if cfg.compile and cfg.compile_backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise ConfigError(
            f"compile_backend={cfg.compile_backend}: not a torch.compile backend; "
            "use inductor (the default) or aot_eager"
        )
    return Prepared(dims, plan, data_plan(cfg, say), checkpoints)


def lr_lambda(cfg: TrainConfig):
    """Linear warmup, then cosine decay to ``min_lr_ratio`` of the peak at ``max_steps``."""
    warmup, total, floor = cfg.optim.warmup_steps, cfg.train.max_steps, cfg.optim.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class Trainer:
    """One job's training: the model, its optimizer and scheduler, the train state, and the
    components that act at their own cadence."""

    def __init__(
        self,
        cfg: TrainConfig,
        prepared: Prepared,
        device: torch.device,
        stop: StopRequest,
    ) -> None:
        self.cfg, self.stop, self.device = cfg, stop, device
        if cfg.debug.deterministic:
            # cuBLAS reads its workspace setting when it starts, before this job's first matmul.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.dims, self.plan = prepared.dims, prepared.plan
        self.rank = dist.get_rank()
        coords = self.dims.coordinates(self.rank)
        self.dp_rank, self.dp_size, self.pp_rank = coords.dp_rank, coords.dp_size, coords.pp
        self.reseed()  # before anything draws (the model's init has generators of its own)
        self.run_dir = Path(cfg.run_dir)
        timeout = process_group_timeout(cfg.train.hang_timeout_s)
        self.meshes = build_meshes(self.dims, device.type, timeout)
        self.model_cfg = model_of(cfg.model)
        self.text = text_codec(cfg.model, self.model_cfg.vocab_size)
        self.options = ParallelizeOptions(
            strategy=cfg.strategy,
            activation_checkpointing=cfg.activation_checkpointing,
            compile=cfg.compile,
            compile_backend=cfg.compile_backend,
            mixed_precision=cfg.mixed_precision,
            loss_chunk=cfg.loss_chunk,
        )
        self.pp_group = self.meshes.pp.get_group() if self.plan is not None else None
        self.runner = self.build_runner()
        # The optimizer, gradient clipping and checkpoints see all of this rank's parameters,
        # named as in the whole model, through one module.
        self.model = merged_view(self.runner.parts)
        self.optimizer = self.build_optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.state = TrainState()
        featurize = Featurizer(prepared.data.extractor, cfg.data.feature_cache)
        self.data = TrainingData(
            cfg,
            prepared.data,
            self.dp_rank,
            self.dp_size,
            self.text,
            featurize,
            device,
            self.model_cfg,
        )
        batch_s = cfg.eval.max_duration or cfg.data.max_duration
        sets = [
            ValidationSet(v.name, v.cuts, batch_s, self.dp_rank, self.dp_size, self.text, featurize)
            for v in prepared.data.validation
        ]
        self.validator = Validator(
            sets,
            self.runner,
            self.meshes,
            self.pp_group,
            cfg.eval.interval,
            device,
            cfg.debug.device_trap,
        )
        self.checkpoints = CheckpointManager(
            self.run_dir,
            keep=cfg.checkpoint.keep,
            async_save=cfg.checkpoint.async_save,
            timeout=timeout,
            interval=cfg.checkpoint.interval,
            location=prepared.checkpoints,
            pretrained=pretrained_dirs(cfg.model),
            by_reference=frozenset(filter(None, map(part_of, referenced_of(cfg)))),
        )
        self.tallies = StepTallies(device)
        self.step_log = StepLog(cfg, device)
        self.stragglers = StragglerWatch(self.runner.parts, cfg.train.straggler, device)
        self.batch_checks = BatchChecks(
            self.run_dir, self.dims, self.rank, cfg.debug.check_batches, cfg.debug.batch_hashes
        )
        self.host_syncs = HostSyncGuard(cfg.debug.host_syncs, cfg.debug.host_sync_warmup, device)
        self.faults = InjectedFaults(cfg.debug, self.rank)
        stop_in = cfg.debug.stop_in if cfg.debug.stop_rank == self.rank else None
        self.watchdog = Watchdog(cfg.train.hang_timeout_s, self.rank, stop_in, self.record_hang)
        self.collector = Collector(cfg.train.gc_interval)
        self.signalled = False  # a stop signal (not a budget) ended training
        self.error: str | None = None  # the error line training stopped on, for the job's record
        self.state_memory: dict[str, int] | None = None  # measured at this job's first step
        self.encoder_cache: EncoderCache | None = None  # train.encoder_cache_mb

    @property
    def step(self) -> int:
        return self.state.step

    @step.setter
    def step(self, value: int) -> None:
        self.state.step = value

    def reseed(self) -> None:
        """This rank's generators from the job seed (train/seeding.py)."""
        seed_rank(self.cfg.seed, self.dp_rank, self.pp_rank)

    def build_runner(self) -> WholeModelRunner | PipelineRunner:
        cfg, options = self.cfg, self.options
        init_seed = cfg.model.init_seed
        if self.plan is None:
            model = build_model(self.model_cfg, self.device, init_seed, self.meshes, options)
            autocast = partial(compute_autocast, options, self.device.type)
            return WholeModelRunner(model, self.device, autocast)
        parts = build_pipeline(
            self.model_cfg, self.device, init_seed, self.meshes, options, self.plan
        )
        bf16 = fsdp_mixed_precision(self.meshes, options)
        hidden_dtype = torch.bfloat16 if bf16 else torch.float32
        return PipelineRunner(
            parts, self.plan, self.pp_group, self.device, hidden_dtype, self.dims.tp
        )

    def build_optimizer(self) -> torch.optim.Optimizer:
        """AdamW over the parameters ``model.freeze`` and ``model.lora`` leave trainable; fused:
        the only AdamW that skips a step on the device (``found_inf``), with no sync."""
        cfg = self.cfg
        trainable = freeze_parameters(self.model, frozen_of(cfg))
        if (cfg.model.freeze or cfg.model.lora.rank) and self.rank == 0:
            count = sum(p.numel() for p in trainable)
            total = sum(p.numel() for p in self.model.parameters())
            why = "model.lora" if cfg.model.lora.rank else "model.freeze"
            say(f"trainable: {count:,} of rank 0's {total:,} parameter elements ({why})")
        return torch.optim.AdamW(
            trainable,
            lr=cfg.optim.lr,
            betas=(cfg.optim.beta1, cfg.optim.beta2),
            weight_decay=cfg.optim.weight_decay,
            fused=True,
        )

    # state ------------------------------------------------------------------------------------

    def trainer_state(self) -> dict:
        """The checkpoint's JSON state. Collective: every rank's data position is gathered."""
        return {
            **self.state.state_dict(),
            **self.data.state_dict(),
            # What train.evaluate needs to rebuild the model, its prompt and find the corpus's
            # test split.
            "model": {**asdict(self.cfg.model), **pretrained_dirs(self.cfg.model)},
            "corpus": str(Path(self.cfg.data.corpus).resolve()),
        }

    def restore(self) -> Path | None:
        """Load the newest checkpoint that loads (rank 0 chooses, a broken one is skipped by
        all ranks), after removing what crashed jobs left; else the pretrained weights."""
        self.checkpoints.remove_leftovers()
        found = self.checkpoints.load_latest(self.model, self.optimizer, self.scheduler)
        if found is None:
            say(f"no checkpoint in {self.run_dir / 'checkpoints'}: starting fresh")
            for part, directory in pretrained_dirs(self.cfg.model).items():
                if directory is not None:
                    PART_LOADERS[part](self.model, Path(directory))
                    say(f"{PARTS[part]} weights loaded from {directory}")
            self.checkpoints.identify_pretrained()
            return None
        latest, state = found
        self.state.load_state_dict(state)
        if not self.data.resume(state, latest):
            # A new job seed draws anew, as it reads a new data order; the same seed continues
            # the generators the checkpoint restored (at the same world size).
            self.reseed()
        say(f"resumed from {latest} at step {self.step}")
        return latest

    def keep_encoder_outputs(self) -> None:
        """With ``train.encoder_cache_mb``, give the model a cache of its frozen encoder's
        outputs, on a replica of the loaded weights (collective: all ranks gather them)."""
        megabytes = self.cfg.train.encoder_cache_mb
        if not megabytes:
            return
        model = self.runner.model
        bf16 = fsdp_mixed_precision(self.meshes, self.options)
        dtype = torch.bfloat16 if bf16 else torch.float32
        replica = encoder_replica(model, self.device, dtype)
        self.encoder_cache = EncoderCache(replica, self.model_cfg, megabytes * MIB)
        model.encoder_cache = self.encoder_cache
        say(f"encoder outputs kept per utterance, up to {megabytes} MiB a rank")

    def diverged(self, error: NonFiniteState) -> TrainingDiverged:
        """A checkpoint refused for non-finite values, as it was saved (sync) or as its
        background check is finalized (async): the job ends as diverged, exit 3."""
        return TrainingDiverged(
            f"step {self.step}: {error}. Lower optim.lr or raise optim.warmup_steps"
        )

    def finalize_save(self, wait: bool) -> None:
        """Complete a background save once every rank wrote it (``wait``: wait for it)."""
        try:
            if wait:
                self.checkpoints.finish()
            else:
                self.checkpoints.poll()
        except NonFiniteState as error:
            raise self.diverged(error) from None

    def save(self) -> None:
        """Save the current state (in the background with checkpoint.async_save); weights or
        optimizer states that are not finite are never saved: the job ends as diverged."""
        self.watchdog.beat(self.step, SAVE)
        self.read_back(stop_flag=0.0)  # tokens seen and the non-finite check are up to date
        try:
            path = self.checkpoints.save(
                self.step, self.model, self.optimizer, self.scheduler, self.trainer_state()
            )
        except NonFiniteState as error:
            raise self.diverged(error) from None
        if self.checkpoints.pending:
            say(f"checkpoint {checkpoint_name(path)}: being written in the background")
        else:
            say(f"checkpoint saved: {path}")
        self.collector.at_pause()

    # loop -------------------------------------------------------------------------------------

    def train_until_stop(self, metrics: MetricsLogger) -> str:
        """Train to max_steps, a stop signal, the time budget or the step budget; the reason."""
        cfg, first_step = self.cfg, self.step
        batches = self.data.batches()
        self.step_log.start(first_step)
        self.stragglers.resume(first_step)
        while self.step < cfg.train.max_steps:
            self.watchdog.beat(self.step, STEP)
            step_batches = [next(batches) for _ in range(cfg.train.grad_accum)]
            self.batch_checks.step(self.step + 1, step_batches)
            lr = self.scheduler.get_last_lr()[0]
            with self.host_syncs.step(self.step - first_step), trapped(cfg.debug.device_trap):
                self.train_step(step_batches)
            self.step += 1
            step, last = self.step, self.step == cfg.train.max_steps
            self.collector.after_step(step)
            if step == first_step + 1:
                log_state_memory(metrics, step, self.rank, self.state_memory)
                write_job_start(self.run_dir, cfg, self.device)
            why = self.sync(step, lr, metrics) or self.step_budget_spent(step - first_step)
            if why is not None and not last:
                return f"stopping at step {step}: {why}"
            if self.checkpoints.due(step, last):
                self.save()
                self.stragglers.resume(step)
            if self.validator.due(step, last):
                self.validate(metrics)
                self.stragglers.resume(step)
        return "max_steps reached"

    def train_step(self, batches: list[LoadedBatch]) -> None:
        """One optimizer step over ``train.grad_accum`` batches, queued on the device; a
        non-finite gradient norm skips it there."""
        counts = global_counts(batches, self.model_cfg, self.device, self.meshes)
        targets, sequences = (counts[COUNTS.index(n)].float() for n in ("targets", "sequences"))
        sums = self.runner.forward_backward(
            [Batch.of(batch) for batch in batches], targets, sequences, self.dims.gradient_ranks
        )
        self.faults.after_backward(self.step + 1, self.model)
        # The global gradient norm is non-finite whenever any rank's loss or gradient is (every
        # gradient is reduced over the ranks), so all ranks skip the same steps.
        grad_norm = clip_grad_norm(self.model, self.cfg.optim.grad_clip, self.pp_group)
        found_inf = (~torch.isfinite(grad_norm)).float()
        measure = self.state_memory is None
        grads = gradient_bytes(self.model) if measure else 0
        self.optimizer.found_inf = found_inf  # read by fused AdamW: the update is skipped
        self.optimizer.step()
        if measure:
            self.state_memory = state_bytes(self.model, self.optimizer, grads)
        self.faults.after_update(self.step + 1, self.model)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.tallies.record(sums, counts, grad_norm, found_inf)

    def sync(self, step: int, lr: float, metrics: MetricsLogger) -> str | None:
        """At a sync step: the figures read back, the metrics line written at a log step, the
        ranks' stop flags agreed and a background save completed; the reason to stop, if any."""
        if not self.step_log.syncs(step):
            return None
        with trapped(self.cfg.debug.device_trap):
            synced = self.read_back(self.stop.local_flag())
        self.signalled = self.stop.signalled(synced.stop_flag)
        if self.step_log.logs(step):
            record = self.step_log.record(
                step, synced, lr, self.state.tokens_seen, self.state.nonfinite_steps
            )
            with trapped(self.cfg.debug.device_trap):
                counts = self.data.cut_counts(self.meshes.dp.get_group())
                ranks = self.stragglers.interval(step)
            metrics.log(step, {**record, **counts, **ranks})
        self.finalize_save(wait=False)
        return self.stop.reason(synced.stop_flag) or self.stragglers.leave_reason()

    def step_budget_spent(self, steps_done: int) -> str | None:
        per_run = self.cfg.train.max_steps_per_run
        if per_run and steps_done >= per_run:
            return f"step budget of this job (train.max_steps_per_run={per_run})"
        return None

    def read_back(self, stop_flag: float) -> Synced | None:
        """The one host sync of a sync step (``StepTallies.read_back``), counted into the train
        state. Raises TrainingDiverged after ``train.nonfinite_limit`` consecutive non-finite
        steps."""
        synced = self.tallies.read_back(self.meshes, self.pp_group, stop_flag)
        if synced is None:
            return None
        self.state.tokens_seen += int(synced.new_targets)
        self.state.nonfinite_steps += int(synced.new_nonfinite)
        self.step_log.add(synced)
        limit = self.cfg.train.nonfinite_limit
        if synced.nonfinite_run >= limit:
            raise TrainingDiverged(
                f"{int(synced.nonfinite_run)} consecutive steps up to step {self.step} had a "
                f"non-finite loss or gradient norm (train.nonfinite_limit={limit}): stopping "
                "without saving; the next job resumes from the last good checkpoint. Lower "
                "optim.lr or raise optim.warmup_steps"
            )
        return synced

    def validate(self, metrics: MetricsLogger) -> None:
        """The validation loss at the current weights (``Validator.run``), watched."""
        self.watchdog.beat(self.step, VALIDATION)
        self.validator.run(self.step, metrics)
        self.collector.at_pause()

    def record_hang(self, step: int, line: str) -> None:
        """The end-of-job record of a job this rank's watchdog ends (exit 5) saying ``line``,
        which the chain retries: written by any rank, as the hung one may be rank 0."""
        record = job_end_record(
            EXIT_HUNG,
            step=step,
            max_steps=self.cfg.train.max_steps,
            signalled=False,
            signal_name=None,
            diverged=False,
            error=line,
        )
        write_job_end(self.run_dir, record, replace=self.rank == 0)

    def run(self) -> int:
        """Restore, train, save and validate, all watched: a rank hung anywhere from the
        checkpoint load to the last validation ends the job (exit 5). Python's collector runs at
        the loop's steps (train/loop/garbage.py)."""
        with self.watchdog, self.collector:
            return self.run_watched()

    def run_watched(self) -> int:
        cfg = self.cfg
        self.watchdog.beat(self.step, RESTORE)
        self.restore()
        if self.step >= cfg.train.max_steps:
            say(f"training already finished at step {self.step} (max_steps {cfg.train.max_steps})")
            return 0
        self.keep_encoder_outputs()
        try:
            self.checkpoints.check_room()  # a full disk fails now, not at the first save
        except CheckpointSaveError as error:
            return self.not_saved(error)
        metrics = self.open_metrics()
        say(
            f"job {os.environ.get(job_env.JOB_INDEX, '-')} seed {cfg.seed}: training steps "
            f"{self.step + 1}..{cfg.train.max_steps}, layout {self.dims.describe()}"
        )
        if self.stop.stop_at is not None:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.stop.stop_at))
            say(f"this job saves and stops by {when}, before its time limit ({job_env.STOP_AT})")
        if self.plan is not None:
            say(self.plan.describe())
        try:
            reason = self.train_until_stop(metrics)
            self.save()
            self.finalize_save(wait=True)  # a job ends only once its checkpoint is complete
        except TrainingDiverged:
            self.finish_good_save()
            metrics.close({"final_step": self.step, "stop_reason": "diverged"})
            say(f"last good checkpoint: {self.checkpoints.latest() or 'none'}")
            raise
        except CheckpointSaveError as error:
            metrics.close({"final_step": self.step, "stop_reason": "checkpoint not saved"})
            return self.not_saved(error)
        if self.signalled:
            say("no validation at the end of this job: a signal asked it to stop")
        elif self.stop.near_time_limit():
            say("no validation at the end of this job: its time limit is near")
        else:
            self.validate(metrics)
        metrics.close({"final_step": self.step, "stop_reason": reason})
        if cfg.compile:
            say(describe_graphs(graph_counts()))
        if self.encoder_cache is not None:
            say(self.encoder_cache.describe())
        say(f"{reason}; tokens seen {self.state.tokens_seen}")
        return 0

    def open_metrics(self) -> MetricsLogger:
        """The run's metrics file and W&B run (the chain's one run, resumed by every job)."""
        cfg = self.cfg
        metrics = MetricsLogger(
            self.run_dir,
            rank=self.rank,
            run_id=self.state.wandb_run_id,
            config={
                **asdict(cfg),
                "layout": self.dims.describe(),
                "pipeline": self.plan.describe() if self.plan else None,
            },
            total_steps=cfg.train.max_steps,
            wandb_enabled=cfg.wandb.enabled,
            wandb_project=cfg.wandb.project,
            wandb_mode=cfg.wandb.mode,
        )
        self.state.wandb_run_id = metrics.run_id
        if self.data.restart is not None:
            metrics.write(self.step, self.data.restart)
        return metrics

    def finish_good_save(self) -> None:
        """On divergence: complete a save still being written if its check finds it finite
        (it holds weights from before the divergence), else leave it refused."""
        try:
            self.checkpoints.finish()
        except (CheckpointSaveError, NonFiniteState) as error:
            say(str(error))

    def not_saved(self, error: CheckpointSaveError) -> int:
        """One error line (rank 0) and the exit code of a checkpoint that cannot be saved."""
        self.error = str(error)
        if self.rank == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        return EXIT_NOT_SAVED
