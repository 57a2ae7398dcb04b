"""LoRA through peft on a pretrained LLM, as a user runs it: ``python -m train`` with
``model.lora``, a chain of two jobs, export merged and as peft's adapter files, evaluation at
another layout; and bad settings refused before anything is queued.

The model is a tiny random Qwen2 (tied head, q/k/v biases, GQA) written by ``save_pretrained``;
every projection carries an adapter, so each TP placement of A and B is exercised.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lhotse import CutSet
from safetensors.torch import load_file

from contract.run_dir import CHECKPOINTS_DIR, MARKER, STATE_FILE, complete_checkpoints
from tests.harness.cluster import queue_ids
from tests.harness.hf_tiny import save_tiny
from tests.harness.models import evaluate, exported, final_model, trained_llm_agrees, trained_model
from tests.harness.process import REPO, run_module, run_tool
from tests.harness.training import TRAPPED_DECODING, TRAPPED_TRAINING
from train.models.hf_names import PROJECTIONS, hf_name
from train.models.init import canonical_name
from train.models.lora import is_adapter

STEPS = 8
# The chain's corpus: 16 training utterances make an epoch of 6 batches at data.max_duration=6,
# so the second of two jobs of STEPS / 2 steps resumes inside the first epoch and crosses into
# the next; 4 test utterances make 2 decoding batches.
TRAIN_CUTS, TEST_CUTS = 16, 4
# What a decoding compares at each layout: the first tokens (the random LLM's adapters barely
# trained, every hypothesis runs to the limit; 128 of them cost a minute at tp=2).
DECODE = ("max_new_tokens=16",)
TP2 = ("parallel.tp=2", "parallel.dp_shard=1")  # the trainer checks that TP peers read alike
LORA = (
    "model.lora.rank=8",
    "model.lora.alpha=16",
    f"model.lora.target_modules=[{','.join(PROJECTIONS)}]",
)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    return save_tiny("qwen2", tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory, corpus) -> Path:
    """The session corpus's first TRAIN_CUTS training and TEST_CUTS test utterances, and its
    dev split (its features are shared)."""
    out = tmp_path_factory.mktemp("small") / "corpus"
    out.mkdir()
    for shared in ("feats", "wavs"):
        (out / shared).symlink_to(corpus / shared)
    for split, first in (("train", TRAIN_CUTS), ("dev", None), ("test", TEST_CUTS)):
        cuts = list(CutSet.from_jsonl_lazy(corpus / f"cuts_{split}.jsonl.gz"))[:first]
        assert first is None or len(cuts) == first
        CutSet.from_cuts(cuts).to_file(out / f"cuts_{split}.jsonl.gz")
    return out


def train(run_dir: Path, corpus: Path, pretrained: Path, *overrides: str, nproc: int = 1) -> str:
    result = run_module(
        "train",
        f"run_dir={run_dir}",
        f"data.corpus={corpus}",
        "data.max_duration=6",
        "wandb.mode=disabled",
        "optim.lr=1e-2",
        "optim.warmup_steps=2",
        f"train.max_steps={STEPS}",
        f"checkpoint.interval={STEPS // 2}",
        f"model.pretrained_llm={pretrained}",
        *LORA,
        *((*TP2, TRAPPED_TRAINING) if nproc == 2 else ()),
        *overrides,
        nproc=nproc,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def chained(tmp_path_factory, small_corpus, pretrained) -> tuple[Path, list[str]]:
    """Two jobs of STEPS / 2 steps each at tp=2, the second resuming the first from an
    asynchronous save inside the first epoch and ending in the second: the run dir and logs."""
    run_dir = tmp_path_factory.mktemp("lora_chain") / "run"
    per_run = (f"train.max_steps_per_run={STEPS // 2}", "checkpoint.async_save=true")
    logs = [train(run_dir, small_corpus, pretrained, *per_run, nproc=2) for _ in range(2)]
    return run_dir, logs


def epoch_at(run_dir: Path, step: int) -> int:
    """The epoch the data position of the run's checkpoint of ``step`` is in."""
    state = json.loads((complete_checkpoints(run_dir)[step] / STATE_FILE).read_text())
    return state["trainer_state"]["data_position"]["epoch"]


def test_a_lora_chain_trains_only_adapters_and_resumes_bitwise(
    chained, small_corpus, pretrained, tmp_path
):
    """The chain's final weights are bitwise those of one job of all the steps at the same
    layout; the LLM's own weights are still the pretrained file's, bitwise; every adapter
    moved; the trainer said what trains."""
    run_dir, (first, second) = chained
    assert "LLM weights loaded" in first and "resumed from" in second
    assert "(model.lora)" in first
    assert epoch_at(run_dir, STEPS // 2) == 0 and epoch_at(run_dir, STEPS) == 1
    alone = tmp_path / "alone"
    train(alone, small_corpus, pretrained, nproc=2)
    chain_weights, one_job = final_model(run_dir), final_model(alone)
    assert chain_weights.keys() == one_job.keys()
    for name, weight in one_job.items():
        assert torch.equal(chain_weights[name], weight), name

    files = load_file(pretrained / "model.safetensors")
    named = {canonical_name(name): weight for name, weight in chain_weights.items()}
    base = {hf_name(name): w for name, w in named.items() if is_llm_base(name)}
    assert base.keys() == files.keys() - {"lm_head.weight"}  # the tied head is the embedding
    for name, weight in base.items():
        assert torch.equal(weight, files[name]), name
    adapters_b = [w for name, w in named.items() if ".lora_B." in name]
    assert len(adapters_b) == 2 * len(PROJECTIONS) and all(w.abs().max() > 0 for w in adapters_b)


def is_llm_base(name: str) -> bool:
    return name.startswith("llm.") and not is_adapter(name)


def logits_of(run_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """The trained LLM's logits (adapters on) for ``tokens``, fp32 on the CPU."""
    model = trained_model(run_dir)
    with torch.no_grad():
        logits, _ = model.llm(model.llm.embed(tokens), torch.ones_like(tokens, dtype=torch.bool))
    return logits


def test_an_exported_lora_model_is_what_trained_merged_and_as_adapters(
    chained, decoded, pretrained, tmp_path
):
    """Merged: transformers loads OUT/llm and computes the trained logits. --adapters: OUT/llm
    is the pretrained LLM bitwise and peft's PeftModel over it with OUT/lora computes them.
    train.evaluate decodes either export (read sharded at tp=2) as it decodes the checkpoint."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from train.export import LLM_DIR, LORA_DIR

    run_dir, _ = chained
    merged = tmp_path / "merged"
    done = exported(run_dir, merged, "--dtype", "fp32")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LoRA merged" in done.stderr and not (merged / LORA_DIR).exists()
    trained_llm_agrees(run_dir, merged / LLM_DIR)

    apart = tmp_path / "apart"
    done = exported(run_dir, apart, "--dtype", "fp32", "--adapters")
    assert done.returncode == 0, done.stderr[-3000:]
    written = load_file(apart / LLM_DIR / "model.safetensors")
    for name, weight in load_file(pretrained / "model.safetensors").items():
        if name != "lm_head.weight":
            assert torch.equal(written[name], weight), name
    base = AutoModelForCausalLM.from_pretrained(apart / LLM_DIR, local_files_only=True)
    adapted = PeftModel.from_pretrained(base, apart / LORA_DIR).eval()
    tokens = torch.tensor([[1, 7, 42, 99, 3, 250, 17, 5, 64]])
    expected = logits_of(run_dir, tokens)
    with torch.no_grad():
        got = adapted(tokens).logits[:, :, : expected.shape[-1]]
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max(), (got - expected).abs().max()
    assert evaluate(apart, *DECODE, "parallel.tp=2", TRAPPED_DECODING, nproc=2)["rows"] == decoded
    from_merged = evaluate(merged, *DECODE)
    assert from_merged["rows"] == decoded and from_merged["summary"]["split"] == "test"


@pytest.fixture(scope="module")
def decoded(chained) -> list[dict]:
    """The chain's test-split hypotheses (their first tokens, DECODE), decoded by one process
    from its checkpoint."""
    run_dir, _ = chained
    rows = evaluate(run_dir, *DECODE)["rows"]
    assert rows
    return rows


def test_a_lora_model_decodes_alike_at_tp2(chained, decoded):
    """train.evaluate rebuilds the adapters from the checkpoint's record: the same hypotheses
    from one process and from tp=2 (A whole and B split, or A split and B whole)."""
    run_dir, _ = chained
    assert evaluate(run_dir, *DECODE, "parallel.tp=2", TRAPPED_DECODING, nproc=2)["rows"] == decoded


def test_an_export_with_adapters_needs_a_lora_run(chained, tmp_path):
    """--adapters on a run without adapters: refused from the checkpoint's record, one line,
    exit 2, nothing written."""
    import shutil

    run_dir, _ = chained
    complete = complete_checkpoints(run_dir)
    newest = complete[max(complete)]
    plain = tmp_path / "plain" / CHECKPOINTS_DIR / newest.name
    plain.mkdir(parents=True)
    shutil.copy(newest / MARKER, plain)
    state = json.loads((newest / STATE_FILE).read_text())
    state["trainer_state"]["model"]["lora"]["rank"] = 0
    (plain / STATE_FILE).write_text(json.dumps(state))
    done = exported(tmp_path / "plain", tmp_path / "out", "--adapters")
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1 and "without LoRA adapters" in errors[0]
    assert not (tmp_path / "out").exists()


BAD = {
    "a hub id": (["model.pretrained_llm=Qwen/Qwen2-0.5B"], "looks like a hub id"),
    "a missing file": (["model.pretrained_llm={missing}"], "config.json"),
    "an unsupported architecture": (["model.pretrained_llm={gpt2}"], "gpt2"),
    "tp not dividing the KV heads": (
        ["model.pretrained_llm={one_kv_head}", "parallel.tp=2", "parallel.dp_shard=1"],
        "tp=2 must divide the 1 KV heads",
    ),
    "a LoRA target that is no projection": (
        ["model.pretrained_llm={qwen2}", "model.lora.rank=4", "model.lora.target_modules=[qkv]"],
        "'qkv' is not a projection",
    ),
    "a negative LoRA rank": (
        ["model.pretrained_llm={qwen2}", "model.lora.rank=-1"],
        "model.lora.rank=-1",
    ),
}


@pytest.mark.slurm
def test_bad_pretrained_settings_are_refused_before_anything_is_queued(
    empty_queue, tmp_path, pretrained
):
    """Through auto_launch: the plan check composes the trainer's config and checks the model
    (config.json read with json, no torch): one error line each, exit 2, nothing queued."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    missing = tmp_path / "missing"
    missing.mkdir()
    gpt2, one_kv_head = tmp_path / "gpt2", tmp_path / "one_kv_head"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2)).save_pretrained(gpt2)
    shape = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
    heads = {"num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 300}
    LlamaForCausalLM(LlamaConfig(**shape, **heads)).save_pretrained(one_kv_head)
    paths = {"missing": missing, "gpt2": gpt2, "qwen2": pretrained, "one_kv_head": one_kv_head}
    for name, (overrides, message) in BAD.items():
        done = run_tool(
            "auto_launch",
            "-n2",
            "--run-dir",
            str(tmp_path / "run"),
            "recipes/train_tiny_fsdp2.yaml",
            "--",
            *(override.format(**paths) for override in overrides),
            cwd=REPO,
        )
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert done.returncode == 2 and len(errors) == 1, (name, done.stderr)
        assert message in errors[0], (name, errors[0])
        assert queue_ids() == [] and not (tmp_path / "run").exists(), name


def test_a_compiled_lora_run_validates_within_its_recompile_budget(tmp_path, corpus, pretrained):
    """peft's LoRA layers inside compiled blocks (fullgraph, selective AC) on the real data
    pipeline, batches of varying shape and validation passes: the run ends, every region
    within its recompile limit. Dynamo's tracing and guards decide the graph count whatever
    compiles the graphs: AOT autograd without inductor's code generation here, as in
    tests/test_trainer_equivalence.py (inductor end to end: tests/test_gpu_check.py)."""
    log = train(
        tmp_path / "run",
        corpus,
        pretrained,
        "train.max_steps=6",
        "checkpoint.interval=6",
        "eval.interval=3",
        "compile=true",
        "compile_backend=aot_eager",
        "activation_checkpointing=selective",
    )
    assert "validation at step 6" in log and "compiled graphs per region" in log


def test_the_plan_prices_adapters_and_a_frozen_llm(pretrained):
    """``orchestrator plan --lora-rank R``: the adapters count as parameters, and only they, the
    encoder and the projector train (what tests/test_planner_memory.py holds exact against the
    trainer's measurement at FSDP x TP)."""
    from train.models.inventory import inventory
    from train.models.lora import with_lora
    from train.models.presets import model_shape

    plan = ("plan", "--model", "tiny", "--hf-config", str(pretrained), "--gpus", "2", "--json")
    whole = json.loads(run_tool("orchestrator", *plan).stdout)
    adapted = json.loads(run_tool("orchestrator", *plan, "--lora-rank", "8").stdout)
    shape = with_lora(model_shape("tiny", str(pretrained)), 8, 16.0, 0.0, ["q_proj", "k_proj"])
    tensors = inventory(shape)
    adapters = sum(t.numel for t in tensors if ".lora_" in t.name)
    llm = sum(t.numel for t in tensors if t.name.startswith("llm.") and ".lora_" not in t.name)
    assert adapted["parameters"] == whole["parameters"] + 2 * adapters  # q, k, v and o
    assert adapted["trainable_parameters"] == whole["parameters"] - llm + 2 * adapters
    refused = run_tool("orchestrator", *plan, "--lora-rank", "8", "--lora-targets", "qkv")
    assert refused.returncode == 2 and "'qkv' is not a projection" in refused.stderr


def test_a_chain_keeps_its_adapters(chained, small_corpus, pretrained):
    """A job whose model.lora differs from the run dir's checkpoint (other rank, or none) is
    refused before it starts: one line naming both, exit 2, the checkpoints untouched. Another
    rank through ``python -m train``; none from the trainer's preflight (checked in this
    process), whose one ConfigError line the command prints the same way."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from contract.configs import PACKAGED_CONFIGS, TRAIN_CONFIG
    from train.config import ConfigError, register
    from train.trainer import preflight

    run_dir, _ = chained
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    job = (
        f"run_dir={run_dir}",
        f"data.corpus={small_corpus}",
        "wandb.mode=disabled",
        f"train.max_steps={2 * STEPS}",
        f"model.pretrained_llm={pretrained}",
        *LORA[1:],
    )
    result = run_module("train", *job, "model.lora.rank=4")
    errors = [line for line in result.stderr.splitlines() if "a chain keeps its adapters" in line]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-2000:]
    assert "rank 8 on q_proj" in errors[0] and "asks for rank 4 on q_proj" in errors[0]
    register()
    with initialize_config_module(PACKAGED_CONFIGS.removeprefix("pkg://"), version_base=None):
        raw = compose(TRAIN_CONFIG, overrides=[*job, "model.lora.rank=0"])
    with pytest.raises(ConfigError, match="a chain keeps its adapters") as refused:
        preflight(OmegaConf.to_object(raw))
    assert "\n" not in str(refused.value)
    assert "rank 8 on q_proj" in str(refused.value) and "asks for none" in str(refused.value)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before
