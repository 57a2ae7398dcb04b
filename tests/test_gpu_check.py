"""bench/gpu_check.sh in its reduced CPU form, as CI runs it, so that the GPU check cannot rot
between the occasions when someone has a GPU for it.

Its train part is also the compiled path's end-to-end test: ``python -m train`` on 2 gloo ranks,
compiled with selective activation checkpointing (CPU inductor), on a real lhotse corpus whose
first training batches hold a single utterance, with validation passes of batches of one and
two. Before the shape policy that run ended with ``FailOnRecompileLimitHit`` at the first
validation pass; here it must hold 4 graphs per region (training and validation, each at batch
one and more), log them as ``recompiles``, and give eager's losses."""

from __future__ import annotations

import csv
import json
import subprocess

import pytest

from tests.helpers import REPO


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
    with (tmp_path / "measurements.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [row["compile"] for row in rows] == ["False", "True"]
    assert [row["gpus"] for row in rows] == ["1", "2"]
    assert all(float(row["step_time_s"]) > 0 for row in rows)
    assert (
        "| recompiles (graphs per region) | 6 (decoder_block 4, encoder_block 4) |" in done.stdout
    )
