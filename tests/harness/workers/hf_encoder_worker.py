"""Loads pretrained speech encoders into the tiny SALM under parallel layouts and trains one step,
for tests/test_hf_encoder.py.

    torchrun --standalone --nproc-per-node=2 tests/harness/workers/hf_encoder_worker.py \
        --out out.pt DIR...
    python tests/harness/workers/hf_encoder_worker.py --out out.pt DIR...  (one plain process)

For each encoder directory and layout (one process; under torchrun FSDP2 over both ranks, and
two pipeline stages, the second without the encoder): build on the meta device, parallelize,
materialize, load the encoder's weights with DCP (each rank reading its shards), then record
the full parameters, the loss of a batch of varied lengths (every rank feeds the whole batch),
how many encoder elements this rank holds, and the parameters and loss after one AdamW step
(the encoder's untrainable tensors frozen, as the trainer freezes them). Rank 0 writes --out:
{layout: {directory: record}}.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.harness.synthetic import built, full_params, save_and_end
from train.config import ModelConfig, TrainConfig
from train.loop.device_trap import trapped
from train.models.batch import Batch
from train.models.build import freeze_parameters
from train.models.hf_weights import encoder_state, load_encoder_weights
from train.models.layers import length_mask
from train.models.loss import loss_targets
from train.models.shape import PAD_ID
from train.parallel.dims import ParallelDims
from train.parallel.layout import frozen_of, model_of
from train.parallel.mesh import build_meshes

FEATURE_LENS = (240, 123, 37, 181)  # some end inside a projector group, some at its end


def varied_batch(bins: int) -> Batch:
    """Zero-padded features of varied lengths and byte transcripts, the same each run."""
    g = torch.Generator().manual_seed(5)
    lens = torch.tensor(FEATURE_LENS)
    features = torch.randn(len(lens), max(FEATURE_LENS), bins, generator=g)
    features = features * length_mask(lens, max(FEATURE_LENS))[..., None]
    token_lens = torch.randint(4, 13, (len(lens),), generator=g)
    tokens = torch.randint(0, 256, (len(lens), int(token_lens.max())), generator=g)
    tokens = torch.where(length_mask(token_lens, tokens.shape[1]), tokens, PAD_ID)
    return Batch(features, lens, tokens, token_lens)


def record(directory: Path, dims: ParallelDims, stride: int) -> dict:
    train_cfg = TrainConfig(
        model=ModelConfig(pretrained_encoder=str(directory), projector_stride=stride)
    )
    cfg = model_of(train_cfg.model)
    meshes = build_meshes(dims, "cpu") if dist.is_initialized() else None
    runner, model, pp_group = built(cfg, dims, meshes)
    load_encoder_weights(model, directory)
    batch = varied_batch(cfg.n_mels)

    def loss() -> float:
        with trapped(True):  # a tensor made off its device fails (train/loop/device_trap.py)
            total = runner.loss_sum(batch)
        if pp_group is not None:  # the last stage holds it
            dist.all_reduce(total, group=pp_group)
        return float(total)

    result = {
        "params": full_params(model, pp_group),
        "loss": loss(),
        "local_elements": sum(
            (p.to_local() if isinstance(p, DTensor) else p).numel()
            for p in encoder_state(model).values()
        ),
    }
    optimizer = torch.optim.AdamW(freeze_parameters(model, frozen_of(train_cfg)), lr=1e-3)
    targets = (loss_targets(batch.token_lens) * dims.dp).float()
    sequences = torch.tensor(float(len(batch.token_lens) * dims.dp))
    with trapped(True):
        runner.forward_backward([batch], targets, sequences, dims.gradient_ranks)
    optimizer.step()
    result["loss_after_step"] = loss()
    result["params_after_step"] = full_params(model, pp_group)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directories", nargs="+", type=Path)
    parser.add_argument("--stride", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    layouts = {"one": ParallelDims(1)}
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
        world = dist.get_world_size()
        layouts = {"fsdp": ParallelDims(world), "pp": ParallelDims(world, dp_shard=1, pp=world)}
    results = {
        name: {str(d): record(d, dims, args.stride) for d in args.directories}
        for name, dims in layouts.items()
    }
    save_and_end(results, args.out)


if __name__ == "__main__":
    main()
