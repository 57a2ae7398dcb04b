"""The training loop every job of every chain runs.

Order of work: validate the config and the layout (before any process group), join the process
group, build the meshes, build the model identically on every rank and parallelize it, restore
the newest complete checkpoint of the run dir (or start fresh), then train until ``max_steps``, a
stop signal or the job's time budget, saving at the checkpoint interval and on the way out.
The job seed drives the data order only; a resumed job with the seed of the checkpoint continues
the same data stream, any other seed starts a new one.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from train.batch_hash import append_batch_hash, batch_hash
from train.checkpoint import CheckpointManager
from train.config import TrainConfig, data_path, validate
from train.data import batches_forever, build_dataloader
from train.mesh import Meshes, build_meshes
from train.metrics import MetricsLogger
from train.models.parallelize import ParallelizeOptions, parallelize
from train.models.presets import flops_per_token, get_preset
from train.models.salm import PAD_ID, SALM, ByteTokenizer, encoder_lens, loss_for_backward
from train.parallel_dims import ParallelDims
from train.stop import StopRequest

# Dense bf16 peak of the GPU, for MFU (H100 SXM); override with ORCH_PEAK_FLOPS.
DEFAULT_PEAK_FLOPS = 989e12


class ConfigError(ValueError):
    """A bad config or layout, found before training starts: exit code 2."""


def say(line: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[train] {line}", file=sys.stderr, flush=True)


def parallel_dims(cfg: TrainConfig, world_size: int) -> ParallelDims:
    p = cfg.parallel
    try:
        dims = ParallelDims(
            world_size=world_size,
            dp_replicate=p.dp_replicate,
            dp_shard=p.dp_shard,
            tp=p.tp,
            ep=p.ep,
            cp=p.cp,
            pp=p.pp,
        )
        dims.validate(get_preset(cfg.model.preset), cfg.strategy)
    except (ValueError, KeyError) as error:
        raise ConfigError(str(error).strip("'\"")) from error
    return dims


def preflight(cfg: TrainConfig) -> ParallelDims:
    """Everything checkable before a process group exists."""
    try:
        validate(cfg)
    except ValueError as error:
        raise ConfigError(str(error)) from error
    return parallel_dims(cfg, int(os.environ.get("WORLD_SIZE", "1")))


def init_distributed() -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
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


def clip_gradients(model: torch.nn.Module, max_norm: float) -> float:
    """Global gradient norm over parameters that may live on different meshes (dense vs EP)."""
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for param in model.parameters():
        if param.grad is not None:
            mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            by_mesh.setdefault(mesh, []).append(param.grad)
    squares = 0.0
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares += float(norm) ** 2
    total = math.sqrt(squares)
    if max_norm > 0 and total > max_norm:
        scale = max_norm / (total + 1e-6)
        for grads in by_mesh.values():
            for grad in grads:
                grad.mul_(scale)
    return total


def check_tp_batches(digest: str, meshes: Meshes) -> None:
    """TP peers must hold byte-identical batches (same data-parallel coordinate, same seed)."""
    group = meshes.tp.get_group()
    digests: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest, group=group)
    if len(set(digests)) != 1:
        raise RuntimeError(
            f"tensor-parallel peers read different first batches ({digests}): the data seed "
            "contract is broken; every rank of a TP group must get the same data-parallel rank"
        )


def mesh_coordinates(dims: ParallelDims, rank: int) -> dict[str, int]:
    coords = dims.coordinates(rank)
    return {
        "dp_replicate": coords.dp_replicate,
        "dp_shard": coords.dp_shard,
        "tp": coords.tp,
        "ep": coords.ep,
        "dp_rank": coords.dp_rank,
    }


class Trainer:
    def __init__(
        self, cfg: TrainConfig, dims: ParallelDims, device: torch.device, stop: StopRequest
    ) -> None:
        self.cfg = cfg
        self.stop = stop
        self.dims = dims
        self.device = device
        self.rank = dist.get_rank()
        self.run_dir = Path(cfg.run_dir)
        self.meshes = build_meshes(dims, device.type)
        self.model_cfg = get_preset(cfg.model.preset)
        torch.manual_seed(cfg.model.init_seed)
        self.model = SALM(self.model_cfg).to(device)
        options = ParallelizeOptions(
            strategy=cfg.strategy,
            activation_checkpointing=cfg.activation_checkpointing,
            compile=cfg.compile,
            mixed_precision=cfg.mixed_precision,
        )
        parallelize(self.model, self.meshes, options)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=cfg.optim.lr,
            betas=(cfg.optim.beta1, cfg.optim.beta2),
            weight_decay=cfg.optim.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.checkpoints = CheckpointManager(self.run_dir, keep=cfg.checkpoint.keep)
        coords = dims.coordinates(self.rank)
        self.dp_rank, self.dp_size = coords.dp_rank, coords.dp_size
        self.coords = mesh_coordinates(dims, self.rank)
        self.step = 0
        self.tokens_seen = 0
        self.wandb_run_id: str | None = None
        self.data_position = {"epoch": 0, "batch_in_epoch": 0, "data_seed": cfg.seed}

    # state ------------------------------------------------------------------------------------

    def trainer_state(self) -> dict:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "wandb_run_id": self.wandb_run_id,
            "data_position": dict(self.data_position),
        }

    def restore(self) -> Path | None:
        latest = self.checkpoints.latest()
        if latest is None:
            say(f"no checkpoint in {self.run_dir / 'checkpoints'}: starting fresh")
            return None
        state = self.checkpoints.load(latest, self.model, self.optimizer, self.scheduler)
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.wandb_run_id = state.get("wandb_run_id")
        saved = state.get("data_position") or {}
        if saved.get("data_seed") == self.cfg.seed:
            self.data_position = dict(saved)
        say(f"resumed from {latest} at step {self.step}")
        return latest

    def save(self) -> None:
        path = self.checkpoints.save(
            self.step, self.model, self.optimizer, self.scheduler, self.trainer_state()
        )
        say(f"checkpoint saved: {path}")

    # data -------------------------------------------------------------------------------------

    def batches(self) -> Iterator[dict]:
        """This rank's batches from the saved position (same seed) or a new order (new seed)."""
        cfg = self.cfg
        tokenizer = ByteTokenizer()
        start_epoch = int(self.data_position["epoch"])
        skip = int(self.data_position["batch_in_epoch"])

        def loader(epoch: int):
            return build_dataloader(
                data_path(cfg),
                max_duration=cfg.data.max_duration,
                job_seed=cfg.seed,
                dp_rank=self.dp_rank,
                dp_size=self.dp_size,
                num_workers=cfg.data.num_workers,
                tokenizer_fn=tokenizer.encode,
                pad_id=PAD_ID,
                shar=cfg.data.shar,
                buckets=cfg.data.buckets,
                epoch=start_epoch + epoch,
            )

        current_epoch = None
        for relative_epoch, batch in batches_forever(loader):
            epoch = start_epoch + relative_epoch
            if epoch != current_epoch:
                current_epoch, index = epoch, 0
            if epoch == start_epoch and index < skip:
                index += 1
                continue
            index += 1
            self.data_position = {"epoch": epoch, "batch_in_epoch": index, "data_seed": cfg.seed}
            yield batch

    # loop -------------------------------------------------------------------------------------

    def train_step(self, batch: dict) -> dict[str, float]:
        features = batch["features"].to(self.device)
        feature_lens = batch["feature_lens"].to(self.device)
        tokens = batch["tokens"].to(self.device)
        token_lens = batch["token_lens"].to(self.device)
        out = self.model(features, feature_lens, tokens, token_lens)
        positions = (encoder_lens(feature_lens) + token_lens).sum()
        sums = torch.stack(
            [
                out.nll_sum.detach().float(),
                out.num_tokens.float(),
                out.aux_loss.detach().float(),
                positions.float(),
            ]
        )
        dist.all_reduce(sums, group=self.meshes.dp.get_group())
        nll, num_tokens, aux, global_positions = sums.tolist()
        loss_for_backward(out, sums[1], self.dp_size).backward()
        grad_norm = clip_gradients(self.model, self.cfg.optim.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {
            "loss": nll / num_tokens + aux / self.dp_size,
            "grad_norm": grad_norm,
            "lr": lr,
            "text_tokens": num_tokens,
            "positions": global_positions,
            "max_len": float(tokens.shape[1] + encoder_lens(features.shape[1])),
        }

    def run(self) -> int:
        cfg = self.cfg
        self.restore()
        if self.step >= cfg.train.max_steps:
            say(f"training already finished at step {self.step} (max_steps {cfg.train.max_steps})")
            return 0
        stop = self.stop
        metrics = MetricsLogger(
            self.run_dir,
            rank=self.rank,
            run_id=self.wandb_run_id,
            config={**asdict(cfg), "layout": self.dims.describe()},
            total_steps=cfg.train.max_steps,
            wandb_enabled=cfg.wandb.enabled,
            wandb_project=cfg.wandb.project,
            wandb_mode=cfg.wandb.mode,
        )
        self.wandb_run_id = metrics.run_id
        say(
            f"job {os.environ.get('ORCH_JOB_INDEX', '-')} seed {cfg.seed}: training steps "
            f"{self.step + 1}..{cfg.train.max_steps}, layout {self.dims.describe()}"
        )
        peak = float(os.environ.get("ORCH_PEAK_FLOPS", DEFAULT_PEAK_FLOPS))
        reason = "max_steps reached"
        first_step = self.step
        batches = self.batches()
        checked = False
        while self.step < cfg.train.max_steps:
            started = time.perf_counter()
            batch = next(batches)
            check_first = not checked and self.dims.tp_enabled and cfg.debug.check_tp_batches
            digest = batch_hash(batch) if check_first or cfg.debug.batch_hashes else ""
            if check_first:
                check_tp_batches(digest, self.meshes)
            checked = True
            if cfg.debug.batch_hashes:
                append_batch_hash(
                    self.run_dir,
                    step=self.step + 1,
                    rank=self.rank,
                    coords=self.coords,
                    digest=digest,
                )
            result = self.train_step(batch)
            self.step += 1
            self.tokens_seen += int(result["text_tokens"])
            step_time = time.perf_counter() - started
            if self.step % cfg.train.log_every == 0 or self.step == cfg.train.max_steps:
                tokens_per_s = result["positions"] / step_time
                record = {
                    "loss": result["loss"],
                    "lr": result["lr"],
                    "grad_norm": result["grad_norm"],
                    "tokens_per_s": tokens_per_s,
                    "step_time_s": step_time,
                    "tokens_seen": self.tokens_seen,
                }
                if self.device.type == "cuda":
                    flops = flops_per_token(self.model_cfg, int(result["max_len"]))
                    record["mfu"] = flops * tokens_per_s / (peak * dist.get_world_size())
                metrics.log(self.step, record)
            why = stop.agreed(self.device)
            per_run = cfg.train.max_steps_per_run
            if why is None and per_run and self.step - first_step >= per_run:
                why = f"step budget of this job (train.max_steps_per_run={per_run})"
            if why is not None and self.step < cfg.train.max_steps:
                reason = f"stopping at step {self.step}: {why}"
                break
            if self.step % cfg.checkpoint.interval == 0 and self.step < cfg.train.max_steps:
                self.save()
        self.save()
        metrics.close({"final_step": self.step, "stop_reason": reason})
        say(f"{reason}; tokens seen {self.tokens_seen}")
        return 0
