"""The real SALM: Whisper tiny.en's encoder and SmolLM2-135M-Instruct (``make pretrained``) in
the project's model, as a user's first run starts (recipes/conf/salm_pretrained.yaml).

What a real checkpoint brings that the tiny random ones never did: a 49,152-token vocabulary, 3
KV heads (TP 1 or 3), tied embeddings, a chat template with its own default system prompt, and
an encoder whose outputs already carry speech. Held to transformers' own outputs at one
process, TP=3 and FSDP2; trained with LoRA and a frozen encoder through a chain of two jobs
that resumes bitwise; exported for transformers and peft; decoded by train.evaluate from the
export; and, at a learning rate too small to move an fp32 weight, exported as its sources.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.harness.cluster import queue_ids
from tests.harness.models import (
    evaluate,
    exported,
    final_model,
    pretrained_model,
    trained_llm_agrees,
    trained_model,
)
from tests.harness.process import REPO, run_module, run_tool
from tests.harness.training import TRAPPED_TRAINING
from tests.harness.workers.pretrained_worker import ENCODER, LAYOUTS, LLM, outputs
from train.checkpoint.saved_run import find_checkpoint
from train.data.loader import load_cuts
from train.exported import ENCODER_DIR, LLM_DIR, LORA_DIR
from train.models.hf_weights import encoder_state

QUESTIONS = ("What is the capital of France?", "Name three colors of the rainbow, please.")
PROMPT_TOKENS = 36  # a multiple of the TP degree: TP splits the sequence
STEPS = 4  # the chain's: two jobs of two steps
RUN = (
    "--config-name",
    "salm_pretrained",
    "data.max_duration=4",
    "wandb.mode=disabled",
    "eval.interval=0",
    "optim.warmup_steps=2",
    "train.log_every=1",
    "checkpoint.interval=100",
    "model.lora.rank=4",
    "model.lora.alpha=8",
    TRAPPED_TRAINING,
)


@pytest.fixture(scope="module")
def inputs(corpus) -> dict[str, torch.Tensor]:
    """Two real chat prompts (SmolLM2's template, its default system prompt), cut to
    PROMPT_TOKENS, and Whisper's 30-s features of two real utterances, (B, 3000, 80)."""
    from transformers import AutoTokenizer, WhisperFeatureExtractor

    tokenizer = AutoTokenizer.from_pretrained(pretrained_model(LLM))
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
        )
        for question in QUESTIONS
    ]
    prompts = [list(getattr(p, "input_ids", p)) for p in prompts]
    assert min(map(len, prompts)) >= PROMPT_TOKENS
    tokens = torch.tensor([p[:PROMPT_TOKENS] for p in prompts])
    cuts = list(load_cuts(corpus / "cuts_test.jsonl.gz"))[:2]
    extractor = WhisperFeatureExtractor.from_pretrained(pretrained_model(ENCODER))
    audio = [cut.load_audio()[0] for cut in cuts]
    features = extractor(audio, sampling_rate=16000, return_tensors="pt").input_features
    full = features.shape[-1]
    return {
        "tokens": tokens,
        "features": features.transpose(1, 2).contiguous(),
        "feature_lens": torch.full((len(cuts),), full),
    }


@pytest.fixture(scope="module")
def reference(inputs) -> dict[str, torch.Tensor]:
    """transformers' own: SmolLM2's logits and Whisper's encoder output."""
    from transformers import AutoModelForCausalLM, WhisperForConditionalGeneration

    llm = AutoModelForCausalLM.from_pretrained(pretrained_model(LLM), dtype=torch.float32).eval()
    whisper = WhisperForConditionalGeneration.from_pretrained(pretrained_model(ENCODER)).eval()
    with torch.no_grad():
        return {
            "logits": llm(inputs["tokens"]).logits,
            "frames": whisper.model.encoder(inputs["features"].transpose(1, 2)).last_hidden_state,
        }


def assert_close_to(got: dict, want: dict, where: str) -> None:
    """fp32, within 1e-5 of the largest value of each output."""
    for key in ("logits", "frames"):
        largest = want[key].abs().max()
        difference = (got[key] - want[key]).abs().max()
        assert difference <= 1e-5 * largest, f"{where}: {key} off by {difference} of {largest}"


def test_the_real_parts_equal_transformers_at_one_process_tp3_and_fsdp2(
    inputs, reference, tmp_path
) -> None:
    """Each rank loads only its shards from the real files; the logits and the encoder's
    frames are transformers' (a RoPE table, a KV-head split or a tied head gone wrong shows)."""
    assert_close_to(outputs(inputs), reference, "one process")
    torch.save(inputs, tmp_path / "inputs.pt")
    done = run_module(
        "tests.harness.workers.pretrained_worker",
        *("--inputs", str(tmp_path / "inputs.pt"), "--out", str(tmp_path / "out.pt")),
        nproc=3,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = torch.load(tmp_path / "out.pt")
    assert results.keys() == LAYOUTS.keys()
    for layout, got in results.items():
        assert_close_to(got, reference, f"{layout} over 3 ranks")


def train(run_dir: Path, corpus: Path, *overrides: str, nproc: int = 2) -> str:
    done = run_module(
        "train", *RUN, f"run_dir={run_dir}", f"data.corpus={corpus}", *overrides, nproc=nproc
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def chained(tmp_path_factory, corpus) -> tuple[Path, list[str]]:
    """Two jobs of two steps at FSDP2 over 2 ranks, LoRA on SmolLM2, Whisper frozen."""
    run_dir = tmp_path_factory.mktemp("salm_chain") / "run"
    logs = [
        train(run_dir, corpus, f"train.max_steps={STEPS}", "train.max_steps_per_run=2")
        for _ in range(2)
    ]
    return run_dir, logs


def test_a_chain_of_the_real_salm_resumes_bitwise_and_trains_adapters_alone(
    chained, corpus, tmp_path
) -> None:
    run_dir, (first, second) = chained
    assert "LLM weights loaded" in first and "encoder weights loaded" in first
    assert "resumed from" in second
    alone = tmp_path / "alone"
    train(alone, corpus, f"train.max_steps={STEPS}")
    chain_weights, one_job = final_model(run_dir), final_model(alone)
    assert chain_weights.keys() == one_job.keys()
    for name, weight in one_job.items():
        assert torch.equal(chain_weights[name], weight), name
    llm_files = load_file(pretrained_model(LLM) / "model.safetensors")
    whisper_files = load_file(pretrained_model(ENCODER) / "model.safetensors")
    model = trained_model(run_dir)
    assert torch.equal(model.llm.embed.weight, llm_files["model.embed_tokens.weight"])
    assert model.llm.lm_head.weight is model.llm.embed.weight, "the tied head came apart"
    for name, tensor in encoder_state(model, "model.encoder.").items():
        assert torch.equal(tensor, whisper_files[name]), name
    moved = [n for n, w in chain_weights.items() if ".lora_B." in n and w.abs().max() > 0]
    assert moved, "no adapter trained"
    held = held_tensors(run_dir)
    assert held and all(".lora_" in key or key.startswith("model.projector.") for key in held)


def held_tensors(run_dir: Path) -> set[str]:
    """The model tensors the run's newest checkpoint holds (DCP's metadata)."""
    import torch.distributed.checkpoint as dcp

    checkpoint = find_checkpoint(run_dir, None, None)
    keys = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    return {key for key in keys if key.startswith("model.")}


@pytest.mark.parametrize(
    ("nproc", "layout"),
    [(1, []), (3, ["parallel.tp=3", "parallel.dp_shard=1"])],
    ids=["one-process", "tp3"],
)
def test_a_chain_resumes_bitwise_from_checkpoints_that_hold_the_frozen_parts_by_reference(
    corpus, tmp_path, nproc, layout
) -> None:
    """One process, and TP=3 (SmolLM2's 3 KV heads and its tied head split in three): two jobs
    of one step end bitwise where one job of two steps does, from checkpoints that hold the
    adapters and the projector alone, SmolLM2 and Whisper by reference (FSDP2: ``chained``)."""
    run_dir, alone = tmp_path / "chain", tmp_path / "alone"
    for _ in range(2):
        train(
            run_dir, corpus, "train.max_steps=2", "train.max_steps_per_run=1", *layout, nproc=nproc
        )
    train(alone, corpus, "train.max_steps=2", *layout, nproc=nproc)
    held = held_tensors(run_dir)
    assert held and all(".lora_" in key or key.startswith("model.projector.") for key in held)
    chain_weights, one_job = final_model(run_dir), final_model(alone)
    assert chain_weights.keys() == one_job.keys()
    for name, weight in one_job.items():
        assert torch.equal(chain_weights[name], weight), name


def test_the_real_salm_exports_for_transformers_and_peft_and_evaluates(chained, tmp_path) -> None:
    """Merged: transformers computes the trained logits from OUT/llm. --adapters: OUT/llm is
    SmolLM2 bitwise and peft's PeftModel with OUT/lora loads. train.evaluate decodes the
    export with SmolLM2's tokenizer and chat template."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir, _ = chained
    merged = tmp_path / "merged"
    done = exported(run_dir, merged, "--dtype", "fp32")
    assert done.returncode == 0, done.stderr[-3000:]
    trained_llm_agrees(run_dir, merged / LLM_DIR)
    assert (merged / ENCODER_DIR / "config.json").is_file()

    apart = tmp_path / "apart"
    done = exported(run_dir, apart, "--dtype", "fp32", "--adapters")
    assert done.returncode == 0, done.stderr[-3000:]
    base = AutoModelForCausalLM.from_pretrained(apart / LLM_DIR, local_files_only=True)
    adapted = PeftModel.from_pretrained(base, apart / LORA_DIR).eval()
    merged_llm = AutoModelForCausalLM.from_pretrained(merged / LLM_DIR, local_files_only=True)
    tokens = torch.tensor([[1, 9690, 198, 2683, 314, 253, 5356, 30, 2]])
    with torch.no_grad():
        want, got = merged_llm(tokens).logits, adapted(tokens).logits
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()

    result = evaluate(merged, "max_new_tokens=8")
    assert result["summary"]["num_utterances"] == len(result["rows"]) > 0


def assert_unmoved(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    """Bitwise where the source is non-zero. The Q4_1 source holds exact zeros (291,645 in
    SmolLM2's embedding: ``d * q + m`` with q and m zero), which any update moves, a step of
    1e-30 by Adam to about 5e-31: those may be that far off, no more."""
    nonzero = want != 0
    assert torch.equal(got[nonzero], want[nonzero]), where
    assert bool((got[~nonzero].abs() <= 1e-29).all()), where


@pytest.mark.parametrize(
    ("nproc", "layout"),
    [(1, []), (3, ["parallel.tp=3", "parallel.dp_shard=1"])],
    ids=["one-process", "tp3"],
)
def test_an_unmoved_real_salm_exports_as_its_sources(corpus, tmp_path, nproc, layout) -> None:
    """Trained by one process, or at TP=3 (3 ranks: SmolLM2's 3 KV heads, the 49,152-row
    vocabulary split in three, the tied head with it), with a learning rate too small to move
    an fp32 weight, every tensor, nothing frozen, saved and exported is its converted source
    (``assert_unmoved``). The run names its sources relative to the checkout, as the recipe
    does; the export runs from elsewhere and finds them where the checkpoint recorded them."""
    run_dir = tmp_path / "run"
    train(
        run_dir,
        corpus,
        "train.max_steps=1",
        "optim.lr=1e-30",
        "model.lora.rank=0",
        "model.freeze=[]",
        *layout,
        nproc=nproc,
    )
    out = tmp_path / "out"
    done = exported(run_dir, out, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for source, folder, prefix in (
        (LLM, LLM_DIR, ""),
        (ENCODER, ENCODER_DIR, "model.encoder."),
    ):
        original = load_file(pretrained_model(source) / "model.safetensors")
        written = load_file(out / folder / "model.safetensors")
        for name, tensor in written.items():
            want = original[prefix + name]
            if name == "model.embed_tokens.weight":
                # One row past SmolLM2's 49,152: the <|audio|> token the prompt adds, at the mean.
                assert tensor.shape[0] == want.shape[0] + 1
                torch.testing.assert_close(tensor[-1], want.mean(dim=0))
                tensor = tensor[:-1]
            assert_unmoved(tensor, want, f"{folder}: {name}")
        expected = {n for n in original if n.startswith(prefix)} - {"lm_head.weight"}
        assert {prefix + n for n in written} == expected, folder


@pytest.mark.slurm
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.pretrained_llm={missing}"], "make pretrained"),
        (["model.pretrained_encoder={missing}"], "make pretrained"),
        (["parallel.tp=2", "parallel.dp_shard=1"], "tp=2 must divide the 9 attention heads"),
    ],
    ids=["llm-missing", "encoder-missing", "tp2-with-3-kv-heads"],
)
def test_bad_settings_of_the_real_salm_queue_nothing(
    empty_queue, corpus, tmp_path, overrides, message
) -> None:
    """Through auto_launch on the loopback cluster: one error line, exit 2, nothing queued and
    no run dir."""
    missing = tmp_path / "data" / "pretrained" / "smollm2-135m"
    done = run_tool(
        "auto_launch",
        *("-n2", "--run-dir", str(tmp_path / "run"), "recipes/train_salm_pretrained.yaml", "--"),
        f"data.corpus={corpus}",
        *(override.format(missing=missing) for override in overrides),
        cwd=REPO,
    )
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr
    assert message in errors[0], errors[0]
    assert queue_ids() == [] and not (tmp_path / "run").exists()
