"""Models a test reads: the converted real models, and a trained run's checkpoint as one model,
its export and its evaluation."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.harness.process import REPO, run_module

if TYPE_CHECKING:
    import torch


def pretrained_model(name: str) -> Path:
    """The converted real model ``name`` (``recipes.pretrained.SOURCES``) that ``make
    pretrained`` writes; missing, the test fails saying how to make it (never a skip)."""
    from recipes.pretrained import DEFAULT_OUT, SOURCES

    path = REPO / DEFAULT_OUT / SOURCES[name].name
    if not (path / "pretrained.json").is_file():
        pytest.fail(f"{path} is missing: run `make pretrained` first", pytrace=False)
    return path


def evaluate(run_dir: Path, *overrides: str, nproc: int = 1, batch_size: int = 2) -> dict:
    """``python -m train.evaluate`` of ``run_dir`` (a run or an export): its summary and rows."""
    result = run_module(
        "train.evaluate", f"run_dir={run_dir}", f"batch_size={batch_size}", *overrides, nproc=nproc
    )
    assert result.returncode == 0, result.stderr[-3000:]
    [summary] = list((run_dir / "eval").glob("step_*/summary.json"))
    hypotheses = summary.parent / "hypotheses.jsonl"
    return {
        "summary": json.loads(summary.read_text()),
        "rows": [json.loads(line) for line in hypotheses.read_text().splitlines()],
    }


def exported(
    run_dir: Path, out: Path, *args: str, cwd: Path = REPO
) -> subprocess.CompletedProcess[str]:
    return run_module("train.export", str(run_dir), "--out", str(out), *args, cwd=cwd)


def trained_llm_agrees(run_dir: Path, folder: Path) -> None:
    """``folder`` (an exported LLM) computes the logits the trained LLM computes, in fp32, and
    is the checkpoint's step: what a user loading it with transformers gets is what trained."""
    import torch
    from transformers import AutoModelForCausalLM

    from train.checkpoint.saved_run import find_checkpoint, saved_model, saved_state
    from train.export import load_trained
    from train.parallel.layout import model_of

    checkpoint = find_checkpoint(run_dir, None, None)
    shape = model_of(saved_model(checkpoint, saved_state(checkpoint)))
    ours = load_trained(run_dir, checkpoint, shape)
    theirs = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype="float32")
    tokens = torch.tensor([[1, 7, 42, 99, 3, 250, 17, 5, 64]])
    with torch.no_grad():
        expected, _ = ours.llm(ours.llm.embed(tokens), torch.ones_like(tokens, dtype=torch.bool))
        got = theirs(tokens).logits[:, :, : shape.vocab_size]
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max(), (got - expected).abs().max()


def trained_model(run_dir: Path):
    """The run's newest checkpoint as one fp32 model on the CPU (adapters included)."""
    from train.checkpoint.saved_run import find_checkpoint, saved_model, saved_state
    from train.export import load_trained
    from train.parallel.layout import model_of

    checkpoint = find_checkpoint(run_dir, None, None)
    shape = model_of(saved_model(checkpoint, saved_state(checkpoint)))
    return load_trained(run_dir, checkpoint, shape)


def final_model(run_dir: Path) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trained_model(run_dir).named_parameters()}
