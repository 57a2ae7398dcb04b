"""Export loses nothing: a pretrained LLM loaded, trained with a learning rate too small to move
an fp32 weight, and exported, is the file it came from, tensor for tensor, bitwise, whether one
process or tp=2 (vocabulary split unevenly, the tied head with it) trained and saved it.

A wrong name in the map, a transposed or resharded slice, a head written twice or a dtype round
trip shows here as a changed tensor.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.harness.hf_tiny import save_tiny
from tests.harness.models import exported
from tests.harness.process import run_module
from train.exported import LLM_DIR


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    return save_tiny("qwen2", tmp_path_factory.mktemp("qwen2"))


@pytest.mark.parametrize("nproc", [1, 2], ids=["one-process", "tp2"])
def test_an_unmoved_pretrained_llm_exports_as_its_own_files(pretrained, corpus, tmp_path, nproc):
    run_dir = tmp_path / "run"
    trained = run_module(
        "train",
        f"run_dir={run_dir}",
        f"data.corpus={corpus}",
        "data.max_duration=6",
        "wandb.mode=disabled",
        "optim.lr=1e-30",
        "train.max_steps=2",
        f"model.pretrained_llm={pretrained}",
        *([f"parallel.tp={nproc}", "parallel.dp_shard=1"] if nproc > 1 else []),
        nproc=nproc,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    done = exported(run_dir, tmp_path / "out")
    assert done.returncode == 0, done.stderr[-3000:]
    original = load_file(pretrained / "model.safetensors")
    written = load_file(tmp_path / "out" / LLM_DIR / "model.safetensors")
    # The tied head is the embedding: written once, as transformers' own save_pretrained does.
    assert written.keys() == original.keys() - {"lm_head.weight"}
    for name, tensor in original.items():
        if name in written:
            assert written[name].dtype == tensor.dtype, name
            assert torch.equal(written[name], tensor), name
