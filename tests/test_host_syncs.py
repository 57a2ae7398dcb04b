"""No host syncs in a training step: the forward, backward, clipping and optimizer of the
trainer's own step, on real corpus batches, read no tensor value back (on a GPU each read
stalls the CPU until the device catches up). Expert parallelism's split sizes are the one
exemption (``train.models.moe.host_split_sizes``), counted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.harness.process import REPO
from tests.harness.workers.host_sync_worker import HostReads

WORKER = REPO / "tests" / "harness" / "workers" / "host_sync_worker.py"
STEPS = 3


def test_the_recorder_sees_every_kind_of_read():
    t = torch.tensor([1.5, 2.0])
    with HostReads() as recorder:
        int(t[0]), t.sum().item(), bool(t[1] > 1)
        t.mul(2).sum()  # no read
    assert len(recorder.reads) == 3, recorder.reads


@pytest.mark.parametrize(
    ("preset", "layout", "reads_per_step"),
    [("tiny", [], 0), ("tiny_moe", ["--ep", "2"], 2)],
    ids=["fsdp2", "moe_ep2"],
)
def test_a_training_step_reads_nothing_back(corpus, tmp_path, preset, layout, reads_per_step):
    out = tmp_path / "result.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(WORKER),
            "--corpus",
            str(corpus),
            "--preset",
            preset,
            *layout,
            "--steps",
            str(STEPS),
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    got = json.loads(out.read_text())
    assert got["reads"] == [], got["reads"]
    # One read of the split sizes per MoE layer and forward under EP: 2 layers in tiny_moe.
    assert got["split_reads"] == STEPS * reads_per_step, got
    assert len(set(got["batch_sizes"])) > 1, got  # real batches: their shapes vary
