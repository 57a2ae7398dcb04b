"""model.freeze / model.unfreeze: which parameters train, from the regex rules to a real run of a
pretrained LLM where the frozen weights stay the file's bitwise and hold no optimizer state."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from orchestrator.planner.cluster import GIB
from orchestrator.planner.plan_check import Capacity, compose_training_config, request_and_layout
from tests.harness.hf_tiny import save_tiny
from tests.harness.process import run_tool
from tests.harness.training import final_weights, train
from train.models.freeze import frozen_names
from train.models.hf_names import hf_name
from train.models.inventory import inventory
from train.models.presets import model_shape

NAMES = [
    "encoder.conv1.weight",
    "projector.0.weight",
    "llm.embed.weight",
    "llm.layers.0.attn.wq.weight",
    "llm.layers.1.attn.wq.weight",
    "llm.layers.1.ffn.w1.weight",
    "llm.norm.weight",
]


def test_freeze_matches_anywhere_and_unfreeze_wins() -> None:
    frozen = frozen_names(NAMES, [r"^llm\."], [r"layers\.1\."])
    assert frozen == {"llm.embed.weight", "llm.layers.0.attn.wq.weight", "llm.norm.weight"}
    assert frozen_names(NAMES, ["attn"], []) == {
        "llm.layers.0.attn.wq.weight",
        "llm.layers.1.attn.wq.weight",
    }
    assert frozen_names(NAMES, [], []) == set()


@pytest.mark.parametrize(
    ("freeze", "unfreeze", "message"),
    [
        (["^llm\\.layer\\."], [], "matches no parameter"),
        (["(llm"], [], "is not a regular expression"),
        (["^llm"], ["encoder"], "matches no frozen parameter"),
        ([".*"], [], "nothing would train"),
    ],
)
def test_a_rule_that_cannot_be_meant_is_one_error_line(freeze, unfreeze, message) -> None:
    with pytest.raises(ValueError, match=message) as error:
        frozen_names(NAMES, freeze, unfreeze)
    assert "\n" not in str(error.value)


def test_a_frozen_pretrained_llm_keeps_its_weights_and_holds_no_optimizer_state(
    tmp_path, corpus
) -> None:
    """The LLM frozen but its second block, under FSDP over 2 ranks: after a few steps the
    frozen tensors are the file's bitwise, the unfrozen block and the encoder moved, and the
    optimizer keeps state for the trainable parameters only (the memory record)."""
    directory = save_tiny("llama", tmp_path / "llama")
    run_dir = tmp_path / "run"
    result = train(
        run_dir,
        corpus,
        "train.max_steps=3",
        "checkpoint.interval=3",
        f"model.pretrained_llm={directory}",
        r"model.freeze=['^llm\.']",
        r"model.unfreeze=['llm\.layers\.1\.']",
        nproc=2,
    )
    assert "trainable:" in result.stdout + result.stderr
    weights = final_weights(run_dir, 3, tmp_path)
    stored = load_file(directory / "model.safetensors")
    moved, kept = [], []
    for name, value in weights.items():
        hf = hf_name(name)
        if hf is None:
            continue
        (moved if not value.equal(stored[hf]) else kept).append(name)
    assert moved and all(name.startswith("llm.layers.1.") for name in moved), moved
    assert all(not name.startswith("llm.layers.1.") for name in kept)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    [memory] = [row["memory"] for row in rows if "memory" in row]
    trainable = sum(
        value.numel() for name, value in weights.items() if not name.startswith("llm.")
    ) + sum(weights[name].numel() for name in moved)
    # AdamW's two fp32 moments of the trainable elements, split over 2 FSDP ranks (padding
    # aside), plus its step counters.
    optimizer = sum(rank["optimizer_bytes"] for rank in memory)
    assert 8 * trainable <= optimizer <= 8 * trainable * 1.1 + 4096, (optimizer, trainable)


def test_a_rule_that_matches_nothing_stops_the_run_before_training(tmp_path, corpus) -> None:
    result = train(tmp_path / "run", corpus, r"model.freeze=['^decoder\.']", check=False)
    assert result.returncode == 2
    assert r"model.freeze: '^decoder\.' matches no parameter" in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_plan_prices_a_frozen_llm_without_its_gradients_and_optimizer_state(tmp_path):
    """``orchestrator plan --hf-config DIR --freeze RE``: the pretrained LLM's shape from its
    config.json, and a frozen LLM costs its weights only (what the run below measures)."""
    directory = save_tiny("qwen2", tmp_path / "qwen2")
    plan = ("plan", "--model", "tiny", "--hf-config", str(directory), "--gpus", "2", "--json")
    whole = json.loads(run_tool("orchestrator", *plan).stdout)
    frozen = json.loads(run_tool("orchestrator", *plan, "--freeze", r"^llm\.").stdout)
    llm = sum(
        t.numel for t in inventory(model_shape("tiny", str(directory))) if t.name[:4] == "llm."
    )
    assert whole["parameters"] == whole["trainable_parameters"] == frozen["parameters"]
    assert frozen["trainable_parameters"] == whole["parameters"] - llm
    # The same layout (the best of the whole model's) in both plans: equal weights; gradients
    # and optimizer state of the encoder and projector only.
    best = whole["best"]["layout"]
    [same] = [item for item in frozen["layouts"] + [frozen["best"]] if item["layout"] == best][:1]
    full, part = whole["best"]["memory_gib"], same["memory_gib"]
    share = frozen["trainable_parameters"] / whole["parameters"]
    assert part["params"] == full["params"]
    assert part["grads"] / full["grads"] == pytest.approx(share, rel=0.02)  # FSDP's padding
    assert part["optimizer"] / full["optimizer"] == pytest.approx(share, rel=0.02)

    refused = run_tool("orchestrator", *plan, "--freeze", r"^decoder\.")
    assert refused.returncode == 2 and "matches no parameter" in refused.stderr


def test_the_launch_check_prices_the_configs_frozen_parameters():
    cfg = compose_training_config(["--config-name", "tiny_fsdp2", r"model.freeze=['^llm\.']"])
    request, _ = request_and_layout(cfg, 1, 2, Capacity(64 * GIB, "a test host", None))
    assert request.frozen and all(name.startswith("llm.") for name in request.frozen)


def test_a_chain_that_unfreezes_the_llm_resumes_with_fresh_moments_for_it(tmp_path, corpus):
    """Stage 1 trains the encoder with the LLM frozen; stage 2 (the next job, the freeze rule
    dropped) resumes from its checkpoint: the LLM's weights load, its AdamW moments start at zero
    (the checkpoint has none), everything else loads strictly, and then the LLM trains too. The
    other way (more frozen) loads the checkpoint's state for what still trains."""
    run_dir = tmp_path / "run"
    common = ("checkpoint.interval=2", "checkpoint.keep=5", "wandb.enabled=false")
    train(run_dir, corpus, "train.max_steps=2", r"model.freeze=['^llm\.']", *common)
    unfrozen = train(run_dir, corpus, "train.max_steps=4", *common)
    assert "resumed from" in unfrozen.stderr and "step_2" in unfrozen.stderr
    output = unfrozen.stdout + unfrozen.stderr  # Hydra's log handler writes to stdout
    fresh = [line for line in output.splitlines() if "starts fresh" in line]
    assert len(fresh) == 1 and "frozen when step_2 was saved" in fresh[0], unfrozen.stderr[-2000:]
    at_2, at_4 = final_weights(run_dir, 2, tmp_path), final_weights(run_dir, 4, tmp_path)
    assert not at_2["llm.layers.0.attn.wq.weight"].equal(at_4["llm.layers.0.attn.wq.weight"])
    refrozen = train(run_dir, corpus, "train.max_steps=6", r"model.freeze=['^encoder\.']", *common)
    assert (
        "starts fresh" not in refrozen.stdout + refrozen.stderr
        and "step_4 at step 4" in refrozen.stderr
    )
