"""The real pretrained parts (Whisper tiny.en's encoder, SmolLM2-135M) in the project's model
under one parallel layout, for tests/test_pretrained_salm.py.

    torchrun --standalone --nproc-per-node=3 -m tests.harness.workers.pretrained_worker \
        --inputs IN --out OUT

For each layout of ``LAYOUTS`` over the ranks (TP over all of them, then FSDP2 over all of
them), builds the SALM as the trainer does (meta device, parallelized, materialized, each rank
loading its shards from the safetensors), then computes, with no gradient, the LLM's logits of
the ``tokens`` of --inputs (a torch file) and the encoder's frames of its ``features`` and
``feature_lens``. Rank 0 writes {layout: outputs} (full tensors) to --out. The one-process
outputs come from ``outputs`` called in the test's own process.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from recipes.pretrained import SMOLLM2, WHISPER
from tests.harness.models import pretrained_model
from tests.harness.synthetic import built, save_and_end
from train.config import ModelConfig
from train.eval.decode import gathered_root, initialize_sharding
from train.loop.device_trap import trapped
from train.models.hf_weights import load_encoder_weights, load_llm_weights
from train.parallel.dims import ParallelDims
from train.parallel.layout import model_of
from train.parallel.mesh import build_meshes

ENCODER, LLM = WHISPER.name, SMOLLM2.name
# Layout name -> (tp, dp_shard) over the world: every rank in one TP group, then in one FSDP2
# group (SmolLM2's 3 KV heads take tp 1 or 3).
LAYOUTS = {"tp": lambda world: (world, 1), "fsdp2": lambda world: (1, world)}


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def outputs(inputs: dict[str, torch.Tensor], tp: int = 1, dp_shard: int = -1) -> dict:
    """The real SALM's LLM logits and encoder frames at the layout (whole in one process)."""
    llm, encoder = pretrained_model(LLM), pretrained_model(ENCODER)
    cfg = model_of(ModelConfig(pretrained_llm=str(llm), pretrained_encoder=str(encoder)))
    meshes, dims = None, ParallelDims(1)
    if dist.is_initialized():
        dims = ParallelDims(dist.get_world_size(), dp_shard=dp_shard, tp=tp)
        dims.validate(cfg)
        meshes = build_meshes(dims, "cpu")
    _, model, _ = built(cfg, dims, meshes)
    load_llm_weights(model, llm)
    load_encoder_weights(model, encoder)
    model.eval()
    initialize_sharding(model)
    tokens = inputs["tokens"]
    mask = torch.ones_like(tokens, dtype=torch.bool)
    # A tensor made off its device in the real parts fails (train/loop/device_trap.py).
    with gathered_root(model), trapped(True):
        logits, _ = model.llm(model.llm.embed(tokens), mask)
        frames, lens = model.encoder(inputs["features"], inputs["feature_lens"])
    return {"logits": full(logits), "frames": full(frames), "frame_lens": lens}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--inputs", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    inputs, world = torch.load(args.inputs), dist.get_world_size()
    results = {name: outputs(inputs, *degrees(world)) for name, degrees in LAYOUTS.items()}
    save_and_end(results, args.out)


if __name__ == "__main__":
    main()
