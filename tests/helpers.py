"""Shared helpers for tests that drive the command lines as a user would."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import pytest

if TYPE_CHECKING:
    import torch

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def missing_capability(reason: str) -> NoReturn:
    """End a test that this machine cannot run (no mount rights, a daemon or a binary missing).

    Locally it is skipped, the reason in pytest's summary. Under CI (``CI=true``, set by
    .ci/run) it fails: a skip there would pass without checking anything, and the Makefile's
    setup targets are meant to provide everything the suite needs.
    """
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (under CI=true a missing capability fails the test)", pytrace=False)
    pytest.skip(reason)


def pretrained_model(name: str) -> Path:
    """The converted real model ``name`` (``recipes.pretrained.SOURCES``) that ``make
    pretrained`` writes; missing, the test fails saying how to make it (never a skip)."""
    from recipes.pretrained import DEFAULT_OUT, SOURCES

    path = REPO / DEFAULT_OUT / SOURCES[name].name
    if not (path / "pretrained.json").is_file():
        pytest.fail(f"{path} is missing: run `make pretrained` first", pytrace=False)
    return path


def run_tool(
    tool: str, *args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / tool), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", **(env or {})},
        timeout=timeout,
    )


def run_script(
    script: Path, *args: str, env: dict | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python SCRIPT ARGS`` from the repository root, as a user runs the repo's scripts."""
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})},
        cwd=REPO,
        timeout=timeout,
    )


def launch_json(*args: str, cwd: Path | None = None, env: dict | None = None) -> dict:
    """Run auto_launch --json and return its summary (its last line)."""
    completed = run_tool("auto_launch", "--json", *args, cwd=cwd, env=env)
    assert completed.returncode == 0, completed.stderr + completed.stdout
    return json.loads(completed.stdout.strip().splitlines()[-1])


def tiny_training_chain(
    run_dir: Path,
    corpus: Path,
    jobs: int,
    retries: int,
    *overrides: str,
    env: dict | None = None,
    launch_args: tuple[str, ...] = (),
) -> dict:
    """``auto_launch`` of the tiny FSDP2 recipe (2 ranks) on ``corpus``, W&B offline; ``env``
    reaches the jobs (sbatch exports the submitting environment)."""
    return launch_json(
        f"-n{jobs}",
        "--retries",
        str(retries),
        "--run-dir",
        str(run_dir),
        *launch_args,
        "recipes/train_tiny_fsdp2.yaml",
        "--",
        f"data.corpus={corpus}",
        "data.max_duration=8",
        "wandb.mode=offline",
        *overrides,
        cwd=REPO,
        env=env,
    )


def chain_status(chain: str) -> dict:
    completed = run_tool("orchestrator", "status", chain, "--json")
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout.strip().splitlines()[-1])


def wait_chain(chain: str, timeout: float = 180) -> dict:
    """Poll until every job has finished, or the first unfinished one can never start."""
    deadline = time.monotonic() + timeout
    while True:
        status = chain_status(chain)
        waiting = [job for job in status["jobs"] if job["state"] not in FINISHED]
        if not waiting or "DependencyNeverSatisfied" in waiting[0]["reason"]:
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"chain {chain} not finished after {timeout} s: {status}")
        time.sleep(1)


def write_sub(path: Path, body: str, directives: str = "#SBATCH --time=00:05:00") -> Path:
    """A hand-written NeMo-style .sub: #SBATCH lines, SEED=$1 required, then ``body``."""
    path.write_text(
        "#!/bin/bash\n"
        + directives.strip()
        + "\n"
        + 'SEED=${1:?"usage: $0 SEED [args]: the job seed is required"}\n'
        + textwrap.dedent(body).lstrip()
    )
    return path


def queue_ids() -> list[str]:
    completed = subprocess.run(
        ["squeue", "--noheader", "--format=%i"], capture_output=True, text=True, timeout=30
    )
    assert completed.returncode == 0, completed.stderr
    return completed.stdout.split()


def wait_gone(job_ids: list[str], timeout: float = 30) -> None:
    """Wait until none of ``job_ids`` is still in the queue (cancelled jobs linger briefly)."""
    deadline = time.monotonic() + timeout
    while set(queue_ids()) & set(job_ids):
        if time.monotonic() > deadline:
            raise AssertionError(
                f"jobs still queued after {timeout} s: {set(queue_ids()) & set(job_ids)}"
            )
        time.sleep(0.5)


def wait_chain_quietly(run_dir: Path, chain_id: str, timeout: float = 180) -> dict:
    """``wait_chain`` without its poll of ``orchestrator status`` every second (a Python start
    and accounting queries each, a share of a core beside the jobs it waits for): squeue (a C
    client) every half second until no job of the chain's manifest is queued, replacements
    and ``--then`` jobs included (a job's hook adds its replacement while the job still runs),
    then the chain's status, polled as ``wait_chain`` does until accounting has every end."""
    deadline = time.monotonic() + timeout
    while set(queue_ids()) & {
        job["job_id"] for job in json.loads((run_dir / "manifest.json").read_text())["jobs"]
    }:
        assert time.monotonic() < deadline, f"chain {chain_id} still queued after {timeout} s"
        time.sleep(0.5)
    return wait_chain(chain_id, timeout=max(30.0, deadline - time.monotonic()))


def fill_disk(disk: Path, leave: int) -> Path:
    """A file that leaves about ``leave`` bytes of ``disk`` free."""
    filler = disk / "filler"
    with open(filler, "wb") as f:
        while (free := shutil.disk_usage(disk).free) > leave:
            try:
                f.write(b"\0" * min(free - leave, 1 << 20))
                f.flush()
            except OSError:
                break
    return filler


@contextmanager
def tmpfs(disk: Path, size: str) -> Iterator[Path]:
    """A real file system of ``size`` (tmpfs) at ``disk`` for the block; where mounting is not
    allowed (not root), a missing capability."""
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        missing_capability(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def run_module(module: str, *args: str, nproc: int = 1) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGS`` from the repository root, under torchrun with ``nproc`` > 1."""
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return subprocess.run(
        [*launcher, "-m", module, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
        timeout=300,
    )


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


def exported(run_dir: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_module("train.export", str(run_dir), "--out", str(out), *args)


def trained_llm_agrees(run_dir: Path, folder: Path) -> None:
    """``folder`` (an exported LLM) computes the logits the trained LLM computes, in fp32, and
    is the checkpoint's step: what a user loading it with transformers gets is what trained."""
    import torch
    from transformers import AutoModelForCausalLM

    from train.export import load_trained
    from train.layout import model_of
    from train.saved_run import find_checkpoint, saved_model, saved_state

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
    from train.export import load_trained
    from train.layout import model_of
    from train.saved_run import find_checkpoint, saved_model, saved_state

    checkpoint = find_checkpoint(run_dir, None, None)
    shape = model_of(saved_model(checkpoint, saved_state(checkpoint)))
    return load_trained(run_dir, checkpoint, shape)


def final_model(run_dir: Path) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trained_model(run_dir).named_parameters()}
