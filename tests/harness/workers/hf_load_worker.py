"""Loads pretrained Hugging Face decoders into the tiny SALM under one parallel layout, for
tests/test_hf_llm.py.

    torchrun --standalone --nproc-per-node=2 tests/harness/workers/hf_load_worker.py --tp 2 \
        --out out.pt DIR...
    python tests/harness/workers/hf_load_worker.py --out out.pt DIR...     (one plain process)

For each model directory: build on the meta device, parallelize, materialize, load the weights
with DCP from the safetensors (each rank reading its shards), then record the full parameters,
the loss of the synthetic batch (every rank feeds the whole batch), whether the output head is
still the embedding, how many elements of each LLM tensor this rank holds, and the loss after
one AdamW step. With --lora-rank R every projection of the LLM gets a LoRA adapter and the LLM's
own weights are frozen (as ``model.lora`` does): two steps are taken and the full parameters
after them recorded too. Rank 0 writes --out: {directory: record}.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.harness.synthetic import built, full_params, save_and_end, synthetic_batch
from train.config import LoraConfig, ModelConfig, TrainConfig
from train.loop.device_trap import trapped
from train.models.build import freeze_parameters
from train.models.hf_names import PROJECTIONS
from train.models.hf_weights import llm_state, load_llm_weights
from train.models.loss import loss_targets
from train.parallel.dims import ParallelDims
from train.parallel.layout import frozen_of, model_of
from train.parallel.mesh import build_meshes


def local_elements(model: torch.nn.Module) -> dict[str, int]:
    """How many elements of each LLM tensor this rank holds (its shard, not the full tensor)."""
    return {
        name: (p.to_local() if isinstance(p, DTensor) else p).numel()
        for name, p in llm_state(model).items()
    }


def lora_config(directory: Path, rank: int) -> TrainConfig:
    """A trainer config of the tiny preset with ``directory``'s LLM, adapted on every
    projection when ``rank`` > 0."""
    lora = LoraConfig(rank=rank, alpha=2.0 * rank, target_modules=list(PROJECTIONS))
    return TrainConfig(model=ModelConfig(pretrained_llm=str(directory), lora=lora))


def record(directory: Path, args: argparse.Namespace) -> dict:
    train_cfg = lora_config(directory, args.lora_rank)
    cfg = model_of(train_cfg.model)
    meshes, dims = None, ParallelDims(1)
    if dist.is_initialized():
        dims = ParallelDims(
            dist.get_world_size(),
            dp_replicate=args.dp_replicate,
            dp_shard=args.dp_shard,
            tp=args.tp,
            pp=args.pp,
            cp=args.cp,
        )
        dims.validate(cfg)
        meshes = build_meshes(dims, "cpu")
    runner, model, pp_group = built(cfg, dims, meshes)
    load_llm_weights(model, directory)
    batch = synthetic_batch()

    def loss() -> float:
        """The batch's loss sum: CP ranks hold parts of it, the last stage holds it under PP."""
        with trapped(True):  # a tensor made off its device fails (train/loop/device_trap.py)
            total = runner.loss_sum(batch)
        for group in (meshes.cp.get_group() if dims.cp_enabled else None, pp_group):
            if group is not None:
                dist.all_reduce(total, group=group)
        return float(total)

    result = {
        "params": full_params(model, pp_group),
        "loss": loss(),
        "tied": cfg.tie_embeddings and model.llm.lm_head.weight is model.llm.embed.weight,
        "local_elements": local_elements(model),
    }
    optimizer = torch.optim.AdamW(freeze_parameters(model, frozen_of(train_cfg)), lr=1e-3)
    # Every data-parallel rank feeds the whole batch, as if each held a copy of it.
    targets = (loss_targets(batch.token_lens) * dims.dp).float()
    sequences = torch.tensor(float(len(batch.token_lens) * dims.dp))
    for _ in range(2 if args.lora_rank else 1):
        with trapped(True):
            runner.forward_backward([batch], targets, sequences, dims.gradient_ranks)
        optimizer.step()
        optimizer.zero_grad()
    result["loss_after_step"] = loss()
    if args.lora_rank:
        result["params_after_steps"] = full_params(model, pp_group)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directories", nargs="+", type=Path)
    for degree in ("dp-replicate", "tp", "pp", "cp"):
        parser.add_argument(f"--{degree}", type=int, default=1)
    parser.add_argument("--dp-shard", type=int, default=-1)
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    results = {str(directory): record(directory, args) for directory in args.directories}
    save_and_end(results, args.out)


if __name__ == "__main__":
    main()
