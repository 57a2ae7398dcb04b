"""Saves and loads tiny-SALM checkpoints under a parallel layout, for tests/test_checkpoint.py.

    torchrun --standalone --nproc-per-node=4 tests/harness/workers/checkpoint_worker.py save \
        --dp-shard 2 --tp 2 --run-dir RUN --out saved.pt
trains a few AdamW steps, saves, records the full parameters, each rank's next random draws and
one more step from the in-memory state; then reloads the checkpoint into a fresh model at the
same layout and records the same things from the loaded state.

    torchrun ... tests/harness/workers/checkpoint_worker.py load --dp-shard 4 --run-dir RUN \
        --out loaded.pt
    python tests/harness/workers/checkpoint_worker.py load --run-dir RUN \
        --out loaded.pt                                              (one plain process)
load the newest checkpoint that loads (as a job starts: leftovers removed first) into a fresh
model and record the same things, and which checkpoint each rank loaded. Rank 0 writes --out.

    torchrun ... tests/harness/workers/checkpoint_worker.py save-two --run-dir RUN --out saved.pt
saves step_1 and step_2, one training step apart, and records the parameters of each.

    torchrun ... tests/harness/workers/checkpoint_worker.py save-then-hang --async-save \
        --run-dir RUN --out X
saves step_1, then starts an asynchronous save of step_2 whose writer hangs once its files are
written (each rank then touches RUN/rank<r>.written) while training goes on, polling: a test
kills it there, in the middle of an asynchronous save.
With ``--pp 2`` the model runs as two pipeline stages (1f1b), through the trainer's runner;
``--cp 2`` splits each sequence over two context-parallel ranks.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.harness.synthetic import full_params, synthetic_batch
from train.checkpoint.manager import CheckpointManager
from train.loop.step import WholeModelRunner
from train.models.batch import Batch
from train.models.build import build_model, build_pipeline
from train.models.loss import loss_targets
from train.models.parallelize import ParallelizeOptions
from train.models.pipeline import PipelineRunner, merged_view
from train.models.presets import get_preset
from train.parallel.dims import ParallelDims
from train.parallel.mesh import build_meshes
from train.parallel.pipeline_plan import pipeline_plan

STEPS = 3
TRAINER_STATE = {
    "step": STEPS,
    "tokens_seen": 1234567,
    "wandb_run_id": "abc123xy",
    "data": {"epoch": 1, "batch_in_epoch": 17, "data_seed": 2024},
}


class Run:
    """A tiny SALM under one layout with its AdamW, warm-up schedule and slice of the batch."""

    def __init__(self, args: argparse.Namespace, model_seed: int) -> None:
        dp_rank, dp_size, self.dp_group, self.pp_group, meshes = 0, 1, None, None, None
        self.gradient_ranks = 1
        cfg, cpu = get_preset("tiny"), torch.device("cpu")
        if dist.is_initialized():
            dims = ParallelDims(
                dist.get_world_size(), dp_shard=args.dp_shard, tp=args.tp, pp=args.pp, cp=args.cp
            )
            meshes = build_meshes(dims, "cpu")
            coords = dims.coordinates(dist.get_rank())
            dp_rank, dp_size, self.dp_group = coords.dp_rank, coords.dp_size, meshes.dp.get_group()
            self.gradient_ranks = dims.gradient_ranks
        if args.pp > 1:
            plan = pipeline_plan(cfg, args.pp, "1f1b", 0, 0, [])
            parts = build_pipeline(cfg, cpu, model_seed, meshes, ParallelizeOptions(), plan)
            self.pp_group = meshes.pp.get_group()
            self.runner = PipelineRunner(parts, plan, self.pp_group, cpu, torch.float32, args.tp)
            self.model = merged_view(parts)
        else:
            self.model = build_model(cfg, cpu, model_seed, meshes)
            self.runner = WholeModelRunner(self.model, cpu)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / 10)
        )
        whole = synthetic_batch()
        per_rank = len(whole.features) // dp_size
        self.batch = Batch(*(t[dp_rank * per_rank : (dp_rank + 1) * per_rank] for t in whole[:4]))

    def step(self) -> None:
        counts = torch.tensor(
            [float(loss_targets(self.batch.token_lens)), float(len(self.batch.token_lens))]
        )
        if self.dp_group is not None:
            dist.all_reduce(counts, group=self.dp_group)
        self.runner.forward_backward([self.batch], counts[0], counts[1], self.gradient_ranks)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()


def rng_draws() -> list:
    """Every rank's next draws from each global generator (a collective)."""
    mine = [torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in "abc"]]
    if not dist.is_initialized():
        return [mine]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def seed_rngs(seed: int) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)


def load_and_step(args: argparse.Namespace, manager: CheckpointManager) -> dict:
    """Load the newest checkpoint into a fresh run; record what it holds, then step once."""
    run = Run(args, model_seed=7)
    seed_rngs(5000)
    started = time.perf_counter()
    manager.remove_leftovers()
    path, trainer_state = manager.load_latest(run.model, run.optimizer, run.scheduler)
    load_s = time.perf_counter() - started
    paths = [str(path)]
    if dist.is_initialized():
        paths = [None] * dist.get_world_size()
        dist.all_gather_object(paths, str(path))
    result = {
        "path": str(path),
        "paths": paths,
        "trainer_state": trainer_state,
        "load_s": load_s,
        "params": full_params(run.model, run.pp_group),
        "lr": run.scheduler.get_last_lr(),
        "draws": rng_draws(),
    }
    run.step()
    result["params_after_step"] = full_params(run.model, run.pp_group)
    return result


def save(args: argparse.Namespace, manager: CheckpointManager) -> dict:
    run = Run(args, model_seed=1234)
    for _ in range(STEPS):
        run.step()
    seed_rngs(1000)
    started = time.perf_counter()
    path = manager.save(STEPS, run.model, run.optimizer, run.scheduler, TRAINER_STATE)
    save_s = time.perf_counter() - started
    result = {
        "path": str(path),
        "save_s": save_s,
        "params": full_params(run.model, run.pp_group),
        "lr": run.scheduler.get_last_lr(),
        "draws": rng_draws(),
    }
    run.step()
    result["params_after_step"] = full_params(run.model, run.pp_group)
    result["reloaded"] = load_and_step(args, manager)
    return result


def save_two(args: argparse.Namespace, manager: CheckpointManager) -> dict:
    """step_1 and step_2, one AdamW step apart; the full parameters of each."""
    run = Run(args, model_seed=1234)
    params = {}
    for step in (1, 2):
        run.step()
        manager.save(step, run.model, run.optimizer, run.scheduler, {"step": step})
        params[step] = full_params(run.model, run.pp_group)
    manager.finish()
    return {"params": params}


def save_then_hang(args: argparse.Namespace, manager: CheckpointManager) -> dict:
    """Save step_1, then train on while step_2's background write hangs after its files."""
    run = Run(args, model_seed=1234)
    run.step()
    manager.save(1, run.model, run.optimizer, run.scheduler, {"step": 1})
    manager.wait()
    written = args.run_dir / f"rank{dist.get_rank() if dist.is_initialized() else 0}.written"
    write_data = dcp.FileSystemWriter.write_data

    def write_then_hang(self, *write_args, **write_kwargs):
        result = write_data(self, *write_args, **write_kwargs)
        written.touch()
        time.sleep(3600)
        return result

    dcp.FileSystemWriter.write_data = write_then_hang
    run.step()
    manager.save(2, run.model, run.optimizer, run.scheduler, {"step": 2})
    while True:
        run.step()
        manager.poll()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load", "save-two", "save-then-hang"])
    parser.add_argument("--dp-shard", type=int, default=-1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--async-save", action="store_true")
    args = parser.parse_args()

    torch.use_deterministic_algorithms(True)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    manager = CheckpointManager(args.run_dir, async_save=args.async_save)
    modes = {"save": save, "load": load_and_step, "save-two": save_two}
    modes["save-then-hang"] = save_then_hang
    result = modes[args.mode](args, manager)
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(result, args.out)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
