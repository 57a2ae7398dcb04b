"""Trains the tiny SALM a few steps on a fixed synthetic global batch and saves losses and weights.

Run plainly for the single-process reference, or under torchrun with a layout:
    torchrun --standalone --nproc-per-node=4 tests/dist_equivalence_worker.py \
        --preset tiny --dp-shard 2 --tp 2 --out result.pt
Each data-parallel rank trains on its slice of every global batch (TP and PP peers on the same
slice), through the trainer's step runners: with ``--grad-accum k`` the slice is cut into k
microbatches of one step, with ``--pp`` it runs through pipeline stages. The result file,
written by rank 0, holds the global losses, the full (gathered) parameters at the start and at
the end, rank 0's number of parameter elements, and torch.compile's counts of graphs and graph
breaks.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.tensor import DTensor

from train.mesh import build_meshes
from train.models.build import build_model, build_pipeline
from train.models.init import canonical_name
from train.models.moe import local_shard
from train.models.parallelize import AC_MODES, ParallelizeOptions
from train.models.pipeline import PipelineRunner, merged_view, pipeline_plan
from train.models.presets import get_preset
from train.models.salm import PAD_ID, loss_targets
from train.parallel_dims import ParallelDims
from train.pipeline_plan import PP_SCHEDULES
from train.step import WholeModelRunner

GLOBAL_BATCH = 4
MODEL_SEED = 1234
DATA_SEED = 99
LR = 0.5


def synthetic_batch() -> tuple[torch.Tensor, ...]:
    """The global batch: random features and byte tokens of varied lengths, the same each run."""
    g = torch.Generator().manual_seed(DATA_SEED)
    feature_lens = torch.randint(24, 49, (GLOBAL_BATCH,), generator=g)
    features = torch.randn(GLOBAL_BATCH, int(feature_lens.max()), 80, generator=g)
    token_lens = torch.randint(4, 13, (GLOBAL_BATCH,), generator=g)
    tokens = torch.randint(0, 256, (GLOBAL_BATCH, int(token_lens.max())), generator=g)
    positions = torch.arange(tokens.shape[1])[None, :]
    tokens = torch.where(positions < token_lens[:, None], tokens, PAD_ID)
    return features, feature_lens, tokens, token_lens


def full_params(model: torch.nn.Module, pp_group=None) -> dict[str, torch.Tensor]:
    """Every parameter gathered to its full shape, from every pipeline stage (a collective: all
    ranks must call it)."""
    params = {
        canonical_name(name): (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }
    if pp_group is None:
        return params
    stages: list[dict | None] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(stages, params, group=pp_group)
    return {name: value for stage in stages for name, value in stage.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--strategy", default="fsdp2", choices=["fsdp2", "ddp"])
    parser.add_argument("--dp-replicate", type=int, default=1)
    parser.add_argument("--dp-shard", type=int, default=-1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--pp-schedule", default="1f1b", choices=PP_SCHEDULES)
    parser.add_argument("--microbatches", type=int, default=0)
    parser.add_argument("--stages-per-rank", type=int, default=0)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--ac", default="none", choices=AC_MODES)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.use_deterministic_algorithms(True)
    cfg = get_preset(args.preset)
    distributed = "WORLD_SIZE" in os.environ
    dp_rank, dp_size, dp_group, pp_group, cp_group, gradient_ranks = 0, 1, None, None, None, 1
    device = torch.device("cpu")
    if distributed:
        dist.init_process_group("gloo")
        dims = ParallelDims(
            world_size=dist.get_world_size(),
            dp_replicate=args.dp_replicate,
            dp_shard=args.dp_shard,
            tp=args.tp,
            ep=args.ep,
            cp=args.cp,
            pp=args.pp,
        )
        dims.validate(cfg, args.strategy)
        meshes = build_meshes(dims, "cpu")
        options = ParallelizeOptions(
            strategy=args.strategy, activation_checkpointing=args.ac, compile=args.compile
        )
        coords = dims.coordinates(dist.get_rank())
        mesh_coords = [m.get_local_rank() for m in (meshes.dp, meshes.tp, meshes.ep, meshes.pp)]
        assert mesh_coords == [coords.dp_rank, coords.tp, coords.ep, coords.pp], mesh_coords
        dp_rank, dp_size, dp_group = coords.dp_rank, coords.dp_size, meshes.dp.get_group()
        gradient_ranks = dims.gradient_ranks
        if dims.cp_enabled:
            cp_group = meshes.cp.get_group()
        if dims.pp_enabled:
            plan = pipeline_plan(
                cfg, dims.pp, args.pp_schedule, args.microbatches, args.stages_per_rank, []
            )
            parts = build_pipeline(cfg, device, MODEL_SEED, meshes, options, plan)
            pp_group = meshes.pp.get_group()
            runner = PipelineRunner(parts, plan, pp_group, device, torch.float32, dims.tp)
            model = merged_view(parts)
        else:
            model = build_model(cfg, device, MODEL_SEED, meshes, options)
            runner = WholeModelRunner(model, device)
    else:
        model = build_model(cfg, device, MODEL_SEED)
        runner = WholeModelRunner(model, device)
    initial = full_params(model, pp_group)
    local_numel = sum(local_shard(p).numel() for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    losses = []
    per_rank = GLOBAL_BATCH // dp_size
    batch = [t[dp_rank * per_rank : (dp_rank + 1) * per_rank] for t in synthetic_batch()]
    micro = per_rank // args.grad_accum
    batches = [tuple(t[i * micro : (i + 1) * micro] for t in batch) for i in range(args.grad_accum)]
    for _ in range(args.steps):
        counts = torch.tensor([float(loss_targets(batch[3])), float(len(batch[3]))])
        if dp_group is not None:
            dist.all_reduce(counts, group=dp_group)
        sums = runner.forward_backward(batches, counts[0], counts[1], gradient_ranks)
        if dp_group is not None:
            dist.all_reduce(sums, group=dp_group)
        if cp_group is not None:  # token losses are per position, balance losses per sequence
            dist.all_reduce(sums[:1], group=cp_group)
        if pp_group is not None:
            dist.all_reduce(sums, group=pp_group)
        nll, aux = sums.tolist()
        optimizer.step()
        optimizer.zero_grad()
        losses.append((nll / counts[0] + aux / counts[1]).item())

    params = full_params(model, pp_group)
    if not distributed or dist.get_rank() == 0:
        result = {
            "losses": losses,
            "params": params,
            "initial": initial,
            "local_numel": local_numel,
            "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": dict(counters["graph_break"]),
        }
        torch.save(result, args.out)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
