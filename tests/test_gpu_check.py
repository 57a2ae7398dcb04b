"""bench/gpu_check.sh in its reduced CPU form, as CI runs it, so that the GPU check cannot rot
between the occasions when someone has a GPU for it."""

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
    assert [(r["compile"], r["ac"]) for r in bench["fast_path"]] == [
        (False, "none"),
        (True, "selective"),
    ]
    assert all(r["tokens_per_s"] > 0 for r in bench["fast_path"])
    assert bench["grouped_gemm_rel_error"] < 1e-5
    assert 0 < bench["checkpoint_stall"]["small"] < 1
    trained = json.loads((tmp_path / "gpu_check_train.json").read_text())
    assert trained["graphs"] == "decoder_block 4, encoder_block 4"
    assert trained["recompiles"] == 6 and len(trained["val_losses"]) == 2
    assert trained["loss_rel_diff_vs_fp32"] < 1e-5  # fp32 on the CPU: compiled equals eager
    with (tmp_path / "measurements.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [row["compile"] for row in rows] == ["False", "True", "True"]
    assert all(float(row["step_time_s"]) > 0 for row in rows)
    assert (
        "| recompiles (graphs per region) | 6 (decoder_block 4, encoder_block 4) |" in done.stdout
    )
