"""The training loop every job of every chain runs.

Order of work: validate the config and the layout (before any process group), join the process
group, build the meshes, build the model identically on every rank and parallelize it, restore
the newest complete checkpoint of the run dir (or start fresh), then train until ``max_steps``, a
stop signal or the job's time budget, saving at the checkpoint interval and on the way out.
The job seed drives the data order and every rank's own generators (train/seeding.py); a resumed
job with the seed of the checkpoint continues the same data stream and draws, any other seed
starts new ones.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from contract import job_env
from contract.job_end import EXIT_HUNG, EXIT_NOT_SAVED, job_end_record, write_job_end
from contract.run_dir import CUTS_PREFIX, VAL_LOSS_PREFIX
from train.batch_hash import append_batch_hash, step_hash
from train.checkpoint.manager import CheckpointManager, CheckpointSaveError, NonFiniteState
from train.config import (
    CONTINUE,
    RESTART_EPOCH,
    ConfigError,
    ModelConfig,
    TrainConfig,
    data_path,
)
from train.data import DataPosition, batches_from, build_dataloader
from train.data_layout import DATA_LAYOUT, data_layout, layout_changes, num_streams, refusal
from train.data_plan import DataPlan, data_plan
from train.features import Featurizer
from train.flops import PEAK_FLOPS_ENV, peak_flops, sequence_flops
from train.host_syncs import OFF, checked_for_host_syncs
from train.layout import frozen_of, model_of, training_layout
from train.memory import STATE_KINDS, gradient_bytes, state_bytes
from train.mesh import build_meshes
from train.metrics import MetricsLogger
from train.models.build import build_model, build_pipeline, encoder_replica, freeze_parameters
from train.models.compiled import describe_graphs, graph_counts, recompiles
from train.models.encoder_cache import MIB, EncoderCache
from train.models.hf_weights import load_encoder_weights, load_llm_weights
from train.models.moe import local_shard
from train.models.parallelize import ParallelizeOptions, compute_autocast, fsdp_mixed_precision
from train.models.pipeline import PipelineRunner, merged_view
from train.models.salm import example_positions, loss_targets
from train.parallel_dims import DENSE_DIMS, ParallelDims
from train.pipeline_plan import PipelinePlan
from train.seeding import seed_rank
from train.step import WholeModelRunner
from train.stop import StopRequest
from train.text import text_codec
from train.validation import ValidationSet
from train.watchdog import RESTORE, SAVE, STEP, VALIDATION, Watchdog, process_group_timeout

BATCH_KEYS = ("features", "feature_lens", "tokens", "token_lens", "audio_at", "target_mask")
COUNTS = ("targets", "positions", "flops", "sequences")  # `global_counts`, in this order


class TrainingDiverged(RuntimeError):
    """Too many consecutive non-finite steps: exit code 3, the last good checkpoint kept."""


def say(line: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[train] {line}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Prepared:
    """What preflight resolved: the layout, the pipeline plan and the checked data."""

    dims: ParallelDims
    plan: PipelinePlan | None
    data: DataPlan


# What a run starts from, by ModelConfig key: the part's name in the log and its loader.
PRETRAINED_PARTS = (
    ("LLM", "pretrained_llm", load_llm_weights),
    ("encoder", "pretrained_encoder", load_encoder_weights),
)


def pretrained_dirs(model: ModelConfig) -> dict[str, str | None]:
    """The config's pretrained directories by key, as the first job loads them and the
    checkpoint records them: absolute, so evaluation and export find them from any working
    directory (None: the preset's own part)."""
    dirs: dict[str, str | None] = {}
    for _, key, _ in PRETRAINED_PARTS:
        directory = getattr(model, key)
        dirs[key] = None if directory is None else str(Path(directory).expanduser().resolve())
    return dirs


def preflight(cfg: TrainConfig) -> Prepared:
    """Everything checkable before a process group exists."""
    dims, plan = training_layout(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    if cfg.compile and cfg.compile_backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise ConfigError(
            f"compile_backend={cfg.compile_backend}: not a torch.compile backend; "
            "use inductor (the default) or aot_eager"
        )
    return Prepared(dims, plan, data_plan(cfg, say))


def init_distributed(hang_timeout_s: float = 0.0) -> torch.device:
    """Join the process group; with ``hang_timeout_s`` its collectives time out a little after
    the hang watchdog would fire (train/watchdog.py), else after torch's default. On CUDA the
    group is bound to this rank's device: NCCL connects now (a bad node fails here, not in the
    first step) and the mesh's subgroups are split from it, one call per mesh dim."""
    timeout = process_group_timeout(hang_timeout_s)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend, device_id = "nccl", device
    else:
        device, backend, device_id = torch.device("cpu"), "gloo", None
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
    else:
        dist.init_process_group(
            backend,
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=timeout,
            device_id=device_id,
        )
    return device


def lr_lambda(cfg: TrainConfig):
    """Linear warmup, then cosine decay to ``min_lr_ratio`` of the peak at ``max_steps``."""
    warmup, total, floor = cfg.optim.warmup_steps, cfg.train.max_steps, cfg.optim.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def clip_grad_norm(
    model: torch.nn.Module, max_norm: float, pp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Clip to ``max_norm`` (0: only measure) and return the global gradient norm, on device.

    Parameters may live on different meshes (TP'd or not, dense or EP experts): each mesh's
    norm is reduced on its own, the norms are combined (and summed over pipeline stages, which
    hold different parameters), and each mesh's gradients are scaled in one foreach call (per
    device and dtype). Nothing is read back to the host.
    """
    by_mesh: dict[object, list[torch.nn.Parameter]] = {}
    for param in model.parameters():
        if param.grad is not None:
            mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            by_mesh.setdefault(mesh, []).append(param)
    squares = []
    for params in by_mesh.values():
        grads = [p.grad for p in params]
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    if squares:
        total = torch.stack(squares).sum()
    else:  # a pipeline stage whose parameters are all frozen
        total = torch.zeros((), device=next(model.parameters()).device)
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    total = total.sqrt()
    if max_norm > 0:
        for params in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total


def check_identical_batches(digest: str, dp_rank: int) -> None:
    """Ranks of one data-parallel coordinate (TP and PP peers) must hold byte-identical batches
    (same data-parallel rank, same seed). One all-gather over the world, at a job's first step."""
    gathered: list[tuple[int, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (dp_rank, digest))
    by_dp_rank: dict[int, dict[int, str]] = {}
    for rank, (peer_dp_rank, peer_digest) in enumerate(gathered):
        by_dp_rank.setdefault(peer_dp_rank, {})[rank] = peer_digest
    for peer_dp_rank, digests in by_dp_rank.items():
        if len(set(digests.values())) != 1:
            raise RuntimeError(
                f"ranks {sorted(digests)} share data-parallel rank {peer_dp_rank} but read "
                f"different first batches ({digests}): the data seed contract is broken; TP and "
                "PP peers must read the same batches"
            )


def mesh_coordinates(dims: ParallelDims, rank: int) -> dict[str, int]:
    """Where ``rank`` sits: its place in each view's dimensions and its data-parallel slot."""
    coords = dims.coordinates(rank)
    return {name: getattr(coords, name) for name in (*DENSE_DIMS, "ep", "dp_rank")}


class Trainer:
    def __init__(
        self,
        cfg: TrainConfig,
        prepared: Prepared,
        device: torch.device,
        stop: StopRequest,
    ) -> None:
        self.cfg = cfg
        self.stop = stop
        if cfg.debug.deterministic:
            # cuBLAS reads its workspace setting when it starts, before this job's first matmul.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.dims = dims = prepared.dims
        self.plan = plan = prepared.plan
        self.data = prepared.data
        self.featurize = Featurizer(prepared.data.extractor, cfg.data.feature_cache)
        self.device = device
        self.rank = dist.get_rank()
        coords = dims.coordinates(self.rank)
        # Before anything draws: the model's own init draws from generators of its own.
        seed_rank(cfg.seed, coords.dp_rank, coords.pp)
        self.run_dir = Path(cfg.run_dir)
        self.meshes = build_meshes(
            dims, device.type, process_group_timeout(cfg.train.hang_timeout_s)
        )
        self.model_cfg = model_of(cfg.model)
        self.text = text_codec(cfg.model, self.model_cfg.vocab_size)
        self.options = ParallelizeOptions(
            strategy=cfg.strategy,
            activation_checkpointing=cfg.activation_checkpointing,
            compile=cfg.compile,
            compile_backend=cfg.compile_backend,
            mixed_precision=cfg.mixed_precision,
        )
        self.pp_group = self.meshes.pp.get_group() if plan is not None else None
        self.runner = self.build_runner()
        # The optimizer, gradient clipping and checkpoints see all of this rank's parameters,
        # named as in the whole model, through one module.
        self.model = merged_view(self.runner.parts)
        trainable = freeze_parameters(self.model, frozen_of(cfg))
        if (cfg.model.freeze or cfg.model.lora.rank) and self.rank == 0:
            count = sum(p.numel() for p in trainable)
            total = sum(p.numel() for p in self.model.parameters())
            why = "model.lora" if cfg.model.lora.rank else "model.freeze"
            say(f"trainable: {count:,} of rank 0's {total:,} parameter elements ({why})")
        # fused: the only AdamW that skips a step on the device (``found_inf``), with no sync.
        self.optimizer = torch.optim.AdamW(
            trainable,
            lr=cfg.optim.lr,
            betas=(cfg.optim.beta1, cfg.optim.beta2),
            weight_decay=cfg.optim.weight_decay,
            fused=True,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.checkpoints = CheckpointManager(
            self.run_dir,
            keep=cfg.checkpoint.keep,
            async_save=cfg.checkpoint.async_save,
            timeout=process_group_timeout(cfg.train.hang_timeout_s),
        )
        self.dp_rank, self.dp_size = coords.dp_rank, coords.dp_size
        self.validation = [
            ValidationSet(
                cuts.name,
                cuts.cuts,
                cfg.eval.max_duration or cfg.data.max_duration,
                self.dp_rank,
                self.dp_size,
                self.text,
                self.featurize,
            )
            for cuts in self.data.validation
        ]
        # Cuts drawn from each training source and cuts skipped, on this rank since the last
        # metrics line (summed over ranks as it is written).
        self.drawn = dict.fromkeys(self.data.source_names, 0)
        self.skipped = 0
        self.validated_step = -1
        stop_in = cfg.debug.stop_in if cfg.debug.stop_rank == self.rank else None
        self.watchdog = Watchdog(cfg.train.hang_timeout_s, self.rank, stop_in, self.record_hang)
        self.signalled = False  # a stop signal (not a budget) ended training
        self.error: str | None = None  # the error line training stopped on, for the job's record
        self.coords = mesh_coordinates(dims, self.rank)
        self.step = 0
        self.tokens_seen = 0
        self.nonfinite_steps = 0
        self.state_memory: dict[str, int] | None = None  # measured at this job's first step
        self.encoder_cache: EncoderCache | None = None  # train.encoder_cache_mb
        self.wandb_run_id: str | None = None
        self.data_position = {"epoch": 0, "batch_in_epoch": 0, "data_seed": cfg.seed}
        read = [check.source for check in self.data.training] if self.data.training else None
        self.data_layout = data_layout(cfg, self.dp_size, read)  # what the position depends on
        self.data_restart: dict | None = None  # a changed layout's new epoch, for metrics.jsonl
        # Device-side tallies, read back only at sync steps (see `read_back`).
        self.since_sync = torch.zeros(len(COUNTS), dtype=torch.float64, device=device)
        self.nonfinite_run = torch.zeros((), device=device)  # consecutive skipped steps
        self.nonfinite_new = torch.zeros((), device=device)  # skipped since the last sync
        # [nll, aux, global targets, global sequences, grad norm] of the last step
        self.last_step: torch.Tensor | None = None
        # Host tallies of the global batches since the last metrics line (for rates and MFU).
        self.since_log = {"time": time.perf_counter(), "step": 0, "positions": 0.0, "flops": 0.0}

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

    # state ------------------------------------------------------------------------------------

    def trainer_state(self) -> dict:
        """The checkpoint's JSON state. Collective: every rank's data position is gathered."""
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "nonfinite_steps": self.nonfinite_steps,
            "wandb_run_id": self.wandb_run_id,
            "data_position": dict(self.data_position),
            "data_positions": self.data_positions(),
            DATA_LAYOUT: self.data_layout,
            # What train.evaluate needs to rebuild the model, its prompt and find the corpus's
            # test split.
            "model": {**asdict(self.cfg.model), **pretrained_dirs(self.cfg.model)},
            "corpus": str(Path(self.cfg.data.corpus).resolve()),
        }

    def restore(self) -> Path | None:
        """Load the newest checkpoint that loads (rank 0 chooses, a broken one is skipped by
        all ranks), after removing what crashed jobs left."""
        self.checkpoints.remove_leftovers()
        found = self.checkpoints.load_latest(self.model, self.optimizer, self.scheduler)
        if found is None:
            say(f"no checkpoint in {self.run_dir / 'checkpoints'}: starting fresh")
            dirs = pretrained_dirs(self.cfg.model)
            for part, key, load in PRETRAINED_PARTS:
                if dirs[key] is not None:
                    load(self.model, Path(dirs[key]))
                    say(f"{part} weights loaded from {dirs[key]}")
            return None
        latest, state = found
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.nonfinite_steps = int(state.get("nonfinite_steps", 0))
        self.wandb_run_id = state.get("wandb_run_id")
        saved = state.get("data_position") or {}
        if saved.get("data_seed") != self.cfg.seed:
            # A new job seed draws anew, as it reads a new data order; the same seed continues
            # the generators the checkpoint restored (at the same world size).
            coords = self.dims.coordinates(self.rank)
            seed_rank(self.cfg.seed, coords.dp_rank, coords.pp)
        else:
            per_rank = state.get("data_positions") or []
            mine = per_rank[self.dp_rank] if self.dp_rank < len(per_rank) else {}
            self.data_position = {**saved, **mine}
            self.resume_data_layout(state.get(DATA_LAYOUT), latest)
        say(f"resumed from {latest} at step {self.step}")
        return latest

    def resume_data_layout(self, saved: dict | None, checkpoint: Path) -> None:
        """The saved position under a changed data layout, as data.on_layout_change says
        (train/data_layout.py); the preflight has refused it already unless it says otherwise."""
        if saved is None:
            return  # saved before layouts were recorded
        changes = layout_changes(saved, self.data_layout)
        if not changes:
            return
        policy = self.cfg.data.on_layout_change
        what = "; ".join(changes)
        if policy == CONTINUE:
            say(
                f"warning: the data layout changed since {checkpoint.name} ({what}); its batch "
                f"counts are applied as they are (data.on_layout_change={CONTINUE}): data may "
                "be skipped or read twice"
            )
        elif policy == RESTART_EPOCH:
            epoch = int(self.data_position.get("epoch", 0)) + 1
            self.data_position = {"epoch": epoch, "batch_in_epoch": 0, "data_seed": self.cfg.seed}
            self.data_restart = {"data_layout_change": RESTART_EPOCH, "data_epoch": epoch}
            say(
                f"the data layout changed since {checkpoint.name} ({what}): starting data epoch "
                f"{epoch} from its beginning (data.on_layout_change={RESTART_EPOCH}); the rest "
                f"of epoch {epoch - 1} is not read"
            )
        else:
            raise ConfigError(refusal(str(checkpoint), changes))

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
            say(f"checkpoint {path.name}: being written in the background")
        else:
            say(f"checkpoint saved: {path}")

    # data -------------------------------------------------------------------------------------

    def data_positions(self) -> list[dict]:
        """Every data-parallel rank's data position, by dp rank (Shar ranks are each at their
        own). Collective: one all-gather over the world."""
        gathered: list[tuple[int, dict] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.dp_rank, self.data_position))
        by_dp_rank = dict(gathered)
        return [
            {k: v for k, v in by_dp_rank[r].items() if k != "data_seed"}
            for r in range(self.dp_size)
        ]

    def batches(self) -> Iterator[dict]:
        """This rank's batches from the saved position (same seed) or a new order (new seed).
        The samplers are put back at the position, not fed the batches again (train/data.py)."""
        cfg = self.cfg
        streams = 1 if self.data.training else num_streams(cfg.data.shar, cfg.data.num_workers)
        start, replay = DataPosition.resume(self.data_position, streams)
        common = {
            "max_duration": cfg.data.max_duration,
            "job_seed": cfg.seed,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "num_workers": cfg.data.num_workers,
            "text": self.text,
            "featurize": self.featurize,
            "buckets": cfg.data.buckets,
            "pin_memory": self.device.type == "cuda",
        }

        data, shar = (
            (self.data.training, False) if self.data.training else (data_path(cfg), cfg.data.shar)
        )

        def loader(epoch: int, position: DataPosition | None):
            return build_dataloader(data, shar=shar, epoch=epoch, position=position, **common)

        for position, batch in batches_from(loader, start, replay):
            self.data_position = {**position.state(), "data_seed": cfg.seed}
            self.note_cuts(batch)
            yield batch

    def note_cuts(self, batch: dict) -> None:
        """Count a batch's cuts by source, and report the cuts its worker had to skip."""
        for source in batch["sources"]:
            if source in self.drawn:
                self.drawn[source] += 1
        for line in batch["skipped"]:
            self.skipped += 1
            print(f"[train] rank {self.rank}: skipped {line}", file=sys.stderr, flush=True)

    # loop -------------------------------------------------------------------------------------

    def global_counts(self, batches: list[dict]) -> torch.Tensor:
        """[loss targets, decoder positions, model FLOPs, sequences] of the step's global
        batch (all its microbatches, all data-parallel ranks), on the device.

        Counted from the batches' CPU length tensors before the forward (tensor arithmetic, no
        value read into Python), then summed over data-parallel ranks on the device: the loss
        is normalized by the global counts with no host sync.
        """
        local = torch.zeros(len(COUNTS), dtype=torch.float64, device="cpu")
        for batch in batches:
            feature_lens, token_lens = batch["feature_lens"].double(), batch["token_lens"].double()
            local += torch.stack(
                [
                    loss_targets(token_lens, batch["target_mask"].double()),
                    (example_positions(self.model_cfg, feature_lens) + token_lens).sum(),
                    sequence_flops(self.model_cfg, feature_lens, token_lens).sum(),
                    torch.tensor(float(len(token_lens)), dtype=torch.float64, device="cpu"),
                ]
            )
        if self.device.type == "cuda":
            local = local.pin_memory()
        counts = local.to(self.device, non_blocking=True)
        dist.all_reduce(counts, group=self.meshes.dp.get_group())
        return counts

    def train_step(self, batches: list[dict]) -> None:
        """One optimizer step over ``train.grad_accum`` batches, queued on the device; a
        non-finite gradient norm skips it there."""
        counts = self.global_counts(batches)
        global_targets = counts[COUNTS.index("targets")].to(torch.float32)
        global_sequences = counts[COUNTS.index("sequences")].to(torch.float32)
        sums = self.runner.forward_backward(
            [tuple(batch[key] for key in BATCH_KEYS) for batch in batches],
            global_targets,
            global_sequences,
            self.dims.gradient_ranks,
        )
        if self.step + 1 in self.cfg.debug.inject_nonfinite_steps and self.rank == 0:
            grad = next(p.grad for p in self.model.parameters() if p.grad is not None)
            local_shard(grad).fill_(float("nan"))
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
        if self.step + 1 in self.cfg.debug.inject_nonfinite_params and self.rank == 0:
            with torch.no_grad():  # as an update that overflows would leave it
                local_shard(next(self.model.parameters())).fill_(float("inf"))
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite_run.add_(found_inf).mul_(found_inf)
        self.nonfinite_new.add_(found_inf)
        self.since_sync.add_(counts)
        self.last_step = torch.cat(
            [sums, torch.stack([global_targets, global_sequences, grad_norm])]
        )

    def read_back(self, stop_flag: float) -> dict[str, float]:
        """The one host sync of a sync step: the last step's loss and gradient norm, the tallies
        since the previous sync, and the ranks' agreed stop flag (MAX of ``stop_flag``).

        Raises TrainingDiverged after ``train.nonfinite_limit`` consecutive non-finite steps.
        """
        if self.last_step is None:
            return {}
        loss_parts = self.last_step[:2].clone()
        dist.all_reduce(loss_parts, group=self.meshes.dp.get_group())
        if self.dims.cp_enabled:  # each CP rank has its positions' token losses
            dist.all_reduce(loss_parts[:1], group=self.meshes.cp.get_group())
        if self.pp_group is not None:  # the loss is on the last stage, balance losses on all
            dist.all_reduce(loss_parts, group=self.pp_group)
        flag = torch.tensor([stop_flag], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        values = torch.cat(
            [
                loss_parts.double(),
                self.last_step[2:].double(),
                self.since_sync,
                torch.stack([self.nonfinite_run, self.nonfinite_new]).double(),
                flag.double(),
            ]
        ).tolist()
        nll, aux, targets, sequences, grad_norm = values[:5]
        new_targets, positions, flops, _ = values[5 : 5 + len(COUNTS)]
        run, new_bad, agreed = values[5 + len(COUNTS) :]
        self.since_sync.zero_()
        self.nonfinite_new.zero_()
        self.tokens_seen += int(new_targets)
        self.nonfinite_steps += int(new_bad)
        self.since_log["positions"] += positions
        self.since_log["flops"] += flops
        limit = self.cfg.train.nonfinite_limit
        if run >= limit:
            raise TrainingDiverged(
                f"{int(run)} consecutive steps up to step {self.step} had a non-finite loss or "
                f"gradient norm (train.nonfinite_limit={limit}): stopping without saving; the "
                "next job resumes from the last good checkpoint. Lower optim.lr or raise "
                "optim.warmup_steps"
            )
        return {
            "loss": nll / targets + aux / sequences,
            "grad_norm": grad_norm,
            "stop_flag": agreed,
        }

    def validate(self, metrics: MetricsLogger) -> None:
        """The loss over every validation set at the current weights (next-token loss only, no
        balance loss): ``val_loss/<name>`` per set and ``val_loss`` pooled over all their
        targets, logged by rank 0."""
        if not self.validation or self.validated_step == self.step:
            return
        self.watchdog.beat(self.step, VALIDATION)
        started = time.perf_counter()
        sums = torch.zeros((len(self.validation), 2), dtype=torch.float64, device=self.device)
        for index, validation in enumerate(self.validation):
            for batch, counts in validation:
                nll = self.runner.loss_sum(tuple(batch[key] for key in BATCH_KEYS))
                if counts:
                    targets = float(loss_targets(batch["token_lens"], batch["target_mask"]))
                    sums[index] += torch.stack(
                        [nll.double(), nll.new_tensor(targets, dtype=torch.float64)]
                    )
        dist.all_reduce(sums, group=self.meshes.dp.get_group())
        # The loss column alone, as a tensor of its own: a column of several sets is not
        # contiguous, and a collective on such a view reduces the wrong elements.
        losses = sums[:, 0].contiguous()
        if self.dims.cp_enabled:  # each CP rank has its positions' token losses
            dist.all_reduce(losses, group=self.meshes.cp.get_group())
        if self.pp_group is not None:  # the loss is on the last stage
            dist.all_reduce(losses, group=self.pp_group)
        sums[:, 0] = losses
        per_set = sums.tolist()
        self.validated_step = self.step
        nll, targets = (sum(column) for column in zip(*per_set, strict=True))
        names = [validation.name for validation in self.validation]
        record: dict[str, float | int | str] = {
            "val_loss": nll / targets,
            "val_tokens": int(targets),
            "val_split": ",".join(names),
        }
        if len(names) > 1:
            for name, (set_nll, set_targets) in zip(names, per_set, strict=True):
                record[f"{VAL_LOSS_PREFIX}{name}"] = set_nll / set_targets
        metrics.log(self.step, record)
        each = ", ".join(
            f"{name} {set_nll / set_targets:.4f}"
            for name, (set_nll, set_targets) in zip(names, per_set, strict=True)
        )
        say(
            f"validation at step {self.step}: val_loss {nll / targets:.4f} over {int(targets)} "
            f"targets ({each}; {time.perf_counter() - started:.1f} s)"
        )

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
        checkpoint load to the last validation ends the job (exit 5)."""
        with self.watchdog:
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
        metrics = MetricsLogger(
            self.run_dir,
            rank=self.rank,
            run_id=self.wandb_run_id,
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
        self.wandb_run_id = metrics.run_id
        if self.data_restart is not None:
            metrics.write(self.step, self.data_restart)
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
        say(f"{reason}; tokens seen {self.tokens_seen}")
        return 0

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

    def peak_flops(self) -> float | None:
        if self.device.type != "cuda":
            return None
        name = torch.cuda.get_device_name(self.device)
        peak = peak_flops(name, os.environ)
        if peak is None:
            say(f"MFU not reported: no peak FLOP/s known for {name!r}; set {PEAK_FLOPS_ENV}")
        return peak

    def train_until_stop(self, metrics: MetricsLogger) -> str:
        """Train to max_steps, a stop signal, the time budget or the step budget; the reason."""
        cfg = self.cfg
        peak = self.peak_flops()
        first_step = self.step
        batches = self.batches()
        self.since_log.update(time=time.perf_counter(), step=self.step)
        has_peers = self.dims.tp_enabled or self.dims.pp_enabled or self.dims.cp_enabled
        while self.step < cfg.train.max_steps:
            self.watchdog.beat(self.step, STEP)
            step_batches = [next(batches) for _ in range(cfg.train.grad_accum)]
            check = self.step == first_step and has_peers and cfg.debug.check_batches
            digest = step_hash(step_batches) if check or cfg.debug.batch_hashes else ""
            if check:
                check_identical_batches(digest, self.dp_rank)
            if cfg.debug.batch_hashes:
                append_batch_hash(
                    self.run_dir,
                    step=self.step + 1,
                    rank=self.rank,
                    coords=self.coords,
                    digest=digest,
                )
            lr = self.scheduler.get_last_lr()[0]
            checked = self.step - first_step >= cfg.debug.host_sync_warmup
            with checked_for_host_syncs(cfg.debug.host_syncs if checked else OFF, self.device):
                self.train_step(step_batches)
            self.step += 1
            if self.step == first_step + 1:
                self.log_state_memory(metrics)
            last = self.step == cfg.train.max_steps
            log_now = self.step % cfg.train.log_every == 0 or last
            why = None
            if log_now or self.step % cfg.train.sync_every == 0:
                result = self.read_back(self.stop.local_flag())
                why = self.stop.reason(result["stop_flag"])
                self.signalled = self.stop.signalled(result["stop_flag"])
                if log_now:
                    metrics.log(self.step, self.log_record(result, lr, peak))
                self.finalize_save(wait=False)
            per_run = cfg.train.max_steps_per_run
            if why is None and per_run and self.step - first_step >= per_run:
                why = f"step budget of this job (train.max_steps_per_run={per_run})"
            if why is not None and not last:
                return f"stopping at step {self.step}: {why}"
            if self.step % cfg.checkpoint.interval == 0 and not last:
                self.save()
            if cfg.eval.interval and self.step % cfg.eval.interval == 0 and not last:
                self.validate(metrics)
        return "max_steps reached"

    def log_state_memory(self, metrics: MetricsLogger) -> None:
        """Every rank's measured parameter, gradient and optimizer-state bytes: one ``memory``
        record (what ``orchestrator plan`` predicts) and one startup line. Collective."""
        gathered: list[dict | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {"rank": self.rank, **(self.state_memory or {})})
        metrics.write(self.step, {"memory": gathered})
        busiest = max(gathered, key=lambda rank: sum(rank[kind] for kind in STATE_KINDS))
        mib = ", ".join(
            f"{kind.split('_')[0]} {busiest[kind] / 2**20:.2f} MiB" for kind in STATE_KINDS
        )
        say(f"state memory of the busiest rank ({busiest['rank']}): {mib}")

    def log_record(
        self, result: dict[str, float], lr: float, peak: float | None
    ) -> dict[str, float]:
        """The metrics line of a log step; rates cover the steps since the previous log line."""
        logged = self.since_log
        now = time.perf_counter()
        elapsed = max(now - logged["time"], 1e-9)
        steps = self.step - int(logged["step"])
        record = {
            "loss": result["loss"],
            "lr": lr,
            "grad_norm": result["grad_norm"],
            "tokens_per_s": logged["positions"] / elapsed,
            "step_time_s": elapsed / steps,
            "tokens_seen": self.tokens_seen,
            "nonfinite_steps": self.nonfinite_steps,
        }
        if peak is not None:
            record["mfu"] = logged["flops"] / (elapsed * peak * dist.get_world_size())
        if self.cfg.compile:
            record["recompiles"] = recompiles(graph_counts())
        record.update(self.cut_counts())
        logged.update(time=now, step=self.step, positions=0.0, flops=0.0)
        return record

    def cut_counts(self) -> dict[str, int]:
        """Cuts drawn from each training source and cuts skipped since the last metrics line,
        summed over data-parallel ranks (``cuts/<source>``, ``skipped_cuts``). Collective."""
        counts = torch.tensor(
            [*self.drawn.values(), self.skipped], dtype=torch.float64, device=self.device
        )
        dist.all_reduce(counts, group=self.meshes.dp.get_group())
        *drawn, skipped = (int(value) for value in counts.tolist())
        record = {f"{CUTS_PREFIX}{name}": n for name, n in zip(self.drawn, drawn, strict=True)}
        self.drawn = dict.fromkeys(self.drawn, 0)
        self.skipped = 0
        return {**record, "skipped_cuts": skipped}
