"""Activation checkpointing's modes (train/models/parallelize.py) train exactly as no
checkpointing, and recompute what each says: ``selective`` no matmul, ``selective_op`` every
second one (torchtitan's per-op policy), ``full`` all of them. Dense and MoE blocks of the
presets, and the blocks of the pretrained Whisper and Parakeet encoders. Their memory, measured
against the planner's formula, is tests/test_planner_activations.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.harness.hf_tiny import save_tiny_encoder
from tests.harness.recompute import training_pass
from tests.harness.synthetic import synthetic_batch
from train.config import ModelConfig
from train.models.build import build_model
from train.models.parallelize import ParallelizeOptions
from train.models.presets import get_preset
from train.parallel.dims import AC_MODES, ParallelDims
from train.parallel.layout import model_of
from train.parallel.mesh import build_meshes

CPU = torch.device("cpu")
MODELS = ("tiny", "tiny_moe", "whisper", "parakeet")


def config(name: str, tmp_path: Path):
    if name in ("whisper", "parakeet"):
        encoder = save_tiny_encoder(name, tmp_path / name)
        return model_of(ModelConfig(pretrained_encoder=str(encoder)))
    return get_preset(name)


@pytest.mark.parametrize("name", MODELS)
def test_each_mode_trains_as_none_and_recomputes_what_it_says(
    name, tmp_path, one_rank_group
) -> None:
    cfg = config(name, tmp_path)
    meshes = build_meshes(ParallelDims(1), "cpu")
    passes = {
        ac: training_pass(
            build_model(cfg, CPU, 1234, meshes, ParallelizeOptions(activation_checkpointing=ac)),
            synthetic_batch(),
        )
        for ac in AC_MODES
    }
    loss, grads, matmuls = passes["none"]
    for ac, (got_loss, got_grads, _) in passes.items():
        assert torch.equal(got_loss, loss), ac
        assert got_grads.keys() == grads.keys(), ac
        for key, grad in grads.items():
            assert torch.equal(got_grads[key], grad), (ac, key)
    recomputed = {ac: count - matmuls for ac, (_, _, count) in passes.items()}
    assert recomputed["selective"] == 0, recomputed
    assert 0 < recomputed["selective_op"] < recomputed["full"], recomputed
    if name == "tiny":
        # Of a block's seven matmuls six feed its backward (w2's output does not): full runs
        # them again, selective_op wk, wo and w3.
        assert recomputed["selective_op"] * 2 == recomputed["full"], recomputed
