"""Trains the tiny SALM a few steps on a fixed synthetic global batch and saves losses and weights.

Run plainly for the single-process reference, or under torchrun with a layout:
    torchrun --standalone --nproc-per-node=4 tests/dist_equivalence_worker.py \
        --preset tiny --dp-shard 2 --tp 2 --out result.pt
Each data-parallel rank trains on its slice of every global batch (TP peers on the same slice);
the result file, written by rank 0, holds the global losses, the full (gathered) parameters at
the start and at the end, rank 0's number of parameter elements, and torch.compile's counts of
graphs and graph breaks.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.tensor import DTensor

from train.mesh import build_meshes
from train.models.build import build_model
from train.models.init import canonical_name
from train.models.moe import local_shard
from train.models.parallelize import AC_MODES, ParallelizeOptions
from train.models.presets import get_preset
from train.models.salm import PAD_ID, loss_for_backward
from train.parallel_dims import ParallelDims

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


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered to its full shape (a collective: all ranks must call it)."""
    return {
        canonical_name(name): (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--strategy", default="fsdp2", choices=["fsdp2", "ddp"])
    parser.add_argument("--dp-replicate", type=int, default=1)
    parser.add_argument("--dp-shard", type=int, default=-1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--ac", default="none", choices=AC_MODES)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.use_deterministic_algorithms(True)
    cfg = get_preset(args.preset)
    distributed = "WORLD_SIZE" in os.environ
    dp_rank, dp_size, dp_group = 0, 1, None
    if distributed:
        dist.init_process_group("gloo")
        dims = ParallelDims(
            world_size=dist.get_world_size(),
            dp_replicate=args.dp_replicate,
            dp_shard=args.dp_shard,
            tp=args.tp,
            ep=args.ep,
        )
        dims.validate(cfg, args.strategy)
        meshes = build_meshes(dims, "cpu")
        options = ParallelizeOptions(
            strategy=args.strategy, activation_checkpointing=args.ac, compile=args.compile
        )
        model = build_model(cfg, torch.device("cpu"), MODEL_SEED, meshes, options)
        coords = dims.coordinates(dist.get_rank())
        mesh_coords = [m.get_local_rank() for m in (meshes.dp, meshes.tp, meshes.ep)]
        assert mesh_coords == [coords.dp_rank, coords.tp, coords.ep], (mesh_coords, coords)
        dp_rank, dp_size, dp_group = coords.dp_rank, coords.dp_size, meshes.dp.get_group()
    else:
        model = build_model(cfg, torch.device("cpu"), MODEL_SEED)
    initial = full_params(model)
    local_numel = sum(local_shard(p).numel() for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    losses = []
    per_rank = GLOBAL_BATCH // dp_size
    batch = [t[dp_rank * per_rank : (dp_rank + 1) * per_rank] for t in synthetic_batch()]
    for _ in range(args.steps):
        out = model(*batch)
        sums = torch.stack([out.nll_sum.detach(), out.num_tokens.float(), out.aux_loss.detach()])
        if dp_group is not None:
            dist.all_reduce(sums, group=dp_group)
        nll, tokens, aux = sums.tolist()
        loss_for_backward(out, sums[1], dp_size).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(nll / tokens + aux / dp_size)

    params = full_params(model)
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
