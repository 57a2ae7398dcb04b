"""bench/gpu_check.sh in its reduced CPU form, as CI runs it, so that the GPU check cannot rot
between the occasions when someone has a GPU for it.

Its train part is also the compiled path's end-to-end test: ``python -m train`` on 2 gloo ranks,
compiled with selective activation checkpointing (CPU inductor), on a real lhotse corpus whose
first training batches hold a single utterance, with validation passes of batches of one and
two. Before the shape policy that run ended with ``FailOnRecompileLimitHit`` at the first
validation pass; here it must hold 4 graphs per region (training and validation, each at batch
one and more), log them as ``recompiles``, and give eager's losses."""

from __future__ import annotations

import json
import subprocess

import pytest

from orchestrator.planner.measured import load
from tests.harness.process import REPO, run_tool


@pytest.mark.slow
def test_gpu_check_runs_on_the_cpu(tmp_path):
    done = subprocess.run(
        ["bash", str(REPO / "bench/gpu_check.sh"), "--cpu", "--out", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    bench = json.loads((tmp_path / "gpu_check_bench.json").read_text())
    assert [(r["compile"], r["ac"]) for r in bench["fast_path"]] == [(False, "none")]
    assert all(r["tokens_per_s"] > 0 for r in bench["fast_path"])
    assert bench["grouped_gemm_rel_error"] < 1e-5
    assert 0 < bench["checkpoint_stall"]["small"] < 1
    trained = json.loads((tmp_path / "gpu_check_train.json").read_text())
    assert trained["graphs"] == "decoder_block 4, encoder_block 4"
    assert trained["recompiles"] == 6 and len(trained["val_losses"]) == 2
    # fp32 on the CPU: compiled equals eager, training and validation.
    assert trained["loss_rel_diff_vs_fp32"] < 1e-5
    assert trained["val_loss_rel_diff_vs_fp32"] < 1e-5
    assert bench["kernels"]["matmul"] and bench["kernels"]["attention"]
    # The measured rows are the planner's table format: orchestrator plan --measured reads them.
    rows = load(tmp_path / "measurements.csv")
    assert [row.plan.split()[:2] for row in rows] == [["--model", "tiny"]] * 2
    assert "--eager" in rows[0].plan and rows[0].layout == "dp_shard=1 microbatches=1 ac=none"
    assert all(row.tokens_per_s_per_gpu > 0 and not row.priced for row in rows)
    priced = run_tool("orchestrator", "plan", "--measured", str(tmp_path / "measurements.csv"))
    assert priced.returncode == 0 and "0 figure(s) outside the bounds" in priced.stdout
    assert (
        "| recompiles (graphs per region) | 6 (decoder_block 4, encoder_block 4) |" in done.stdout
    )
