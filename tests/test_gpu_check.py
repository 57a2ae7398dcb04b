"""bench/gpu_check.sh in its reduced CPU form, as CI runs it, so that the GPU check cannot rot
between the occasions when someone has a GPU for it.

Its flows are also end-to-end tests of their own: ``python -m train`` on 2 gloo ranks, compiled
with selective activation checkpointing (dynamo and AOT autograd, ``compile_backend=aot_eager``:
inductor's CPU code is no GPU's, and its lowering of the blocks is held to eager by
tests/test_trainer_equivalence.py) on a real lhotse corpus whose first training batches hold a
single utterance and whose validation batches hold one or two (the shape policy's budget: 4
graphs per region, eager's losses); the same as a chain of two jobs whose second resumes
bitwise, with asynchronous checkpoints; the real Whisper tiny.en encoder under LoRA adapters,
compiled; evaluation with the KV cache and an export that transformers reloads; speech, NeMo
conversations and text pairs mixed, compiled, and their conversations decoded alike on two
devices. Its speed part runs the fast path and the torchtitan comparison tiny, so that both
keep working."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from bench.gpu_flows import decoded, differences
from orchestrator.planner.measured import load
from recipes.pretrained import WHISPER
from tests.harness.models import pretrained_model
from tests.harness.process import REPO, run_tool


# Nine training processes, most compiling, on two cores beside the suite's other worker: 7 min
# alone on 2026-11-29 (9.4 min while they compiled with inductor).
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_gpu_check_runs_on_the_cpu(tmp_path):
    whisper = pretrained_model(WHISPER.name)
    command = ["bash", str(REPO / "bench/gpu_check.sh"), "--cpu", "--out", str(tmp_path)]
    done = subprocess.run(
        [*command, "--whisper", str(whisper)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1400,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    flows = json.loads((tmp_path / "gpu_check_flows.json").read_text())
    # The chain's second job continues the uninterrupted run bit for bit.
    assert flows["resumed_steps"] == 3
    assert flows["bitwise"] == {"loss": True, "grad_norm": True, "val_loss": True}
    assert flows["graphs"] == "decoder_block 4, encoder_block 4"
    assert flows["recompiles"] == 6 and len(flows["val_losses"]) == 2
    # fp32 on the CPU: compiled equals eager, training and validation.
    assert flows["loss_rel_diff_vs_fp32"] < 1e-5
    assert flows["val_loss_rel_diff_vs_fp32"] < 1e-5
    assert flows["host_syncs"] == [] and flows["nondeterministic_ops"] == []
    assert flows["decoded"] > 0 and flows["decode_differences"] == []
    assert flows["export_rel_diff"] < 1e-4
    lora = flows["whisper_lora"]
    assert lora["decoded"] > 0 and lora["last_loss"] < lora["first_loss"]
    assert lora["graphs"] and "decoder_block" in lora["graphs"]
    # Batches of one, two and no audio turns per sequence through the compiled blocks; both
    # sets validated apart, every conversation and text pair decoded alike on both devices.
    mix = flows["mixture"]
    assert mix["last_loss"] < mix["first_loss"] and "decoder_block" in mix["graphs"]
    assert set(mix["val_losses"]) == {"val_loss", "val_loss/spoken", "val_loss/text"}
    assert mix["decoded"] > 0 and mix["decode_differences"] == []

    speed = json.loads((tmp_path / "gpu_check_speed.json").read_text())
    assert [(r["compile"], r["ac"]) for r in speed["fast_path"]] == [(False, "none")]
    assert all(r["tokens_per_s"] > 0 for r in speed["fast_path"])
    assert speed["grouped_gemm_rel_error"] < 1e-5
    # Both models built and parallelized by their own code, trained on the same tokens: each
    # loss starts near ln(vocab) and falls.
    titan = speed["torchtitan"]
    assert [(row["shape"], row["impl"]) for row in titan["rows"]] == [
        ("tiny", "ours"),
        ("tiny", "torchtitan"),
    ]
    for row in titan["rows"]:
        losses = row["losses"]
        assert row["tokens_per_s"] > 0 and all(math.isfinite(loss) for loss in losses)
        assert abs(losses[0] - titan["ln_vocab"]["tiny"]) < 1.0 and losses[-1] < losses[0], losses
    [ratio] = titan["ratios"]
    assert ratio["shape"] == "tiny" and ratio["tokens_per_s"] > 0
    assert "| tiny: ours / torchtitan |" in done.stdout
    extra = json.loads((tmp_path / "gpu_check_extra.json").read_text())
    assert extra["kernels"]["matmul"] and extra["kernels"]["attention"]
    assert 0 < extra["checkpoint_stall"]["small"] < 1
    # The measured rows are the planner's table format: orchestrator plan --measured reads them.
    rows = load(tmp_path / "measurements.csv")
    assert [row.plan.split()[:2] for row in rows] == [["--model", "tiny"]]
    assert "--eager" in rows[0].plan and rows[0].layout == "dp_shard=1 microbatches=1 ac=none"
    assert all(row.tokens_per_s_per_gpu > 0 and not row.priced for row in rows)
    priced = run_tool("orchestrator", "plan", "--measured", str(tmp_path / "measurements.csv"))
    assert priced.returncode == 0 and "0 figure(s) outside the bounds" in priced.stdout
    assert (
        "| recompiles (graphs per region) | 6 (decoder_block 4, encoder_block 4) |" in done.stdout
    )
    assert_decoding_comparison_fires(tmp_path)


def assert_decoding_comparison_fires(out: Path) -> None:
    """On the CPU both of the check's evaluations ran there, so its empty list of decoding
    differences is what a blind comparison gives too: on the chain's two evaluations as they
    were written, a hypothesis planted in one and an utterance the other lost are each found."""
    device, cpu = decoded(out / "chain"), decoded(out / "chain_cpu")
    assert len(device) > 1 and differences(device, cpu) == []
    planted = plant(out / "chain_cpu", 0, "planted")
    dropped = plant(out / "chain", -1, None)
    assert differences(decoded(out / "chain"), decoded(out / "chain_cpu")) == sorted(
        [planted, dropped]
    )


def plant(run_dir: Path, index: int, hypothesis: str | None) -> str:
    """Give the ``index``-th utterance of ``run_dir``'s evaluation ``hypothesis`` (None: drop
    it); its key in ``decoded``."""
    [step] = list((run_dir / "eval").glob("step_*"))
    [written] = list(step.rglob("hypotheses.jsonl"))
    rows = [json.loads(line) for line in written.read_text().splitlines()]
    key = str(written.parent.relative_to(step) / rows[index]["id"])
    if hypothesis is None:
        rows.pop(index)
    else:
        rows[index]["hypothesis"] = hypothesis
    written.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return key
