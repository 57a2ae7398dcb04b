"""Every tensor the training step, validation and decoding make is made on its device.

A tensor made without ``device=`` lands on the CPU; on a GPU the op that mixes it with the
model's tensors fails, and only there (once: a CPU ``torch.eye`` OR-ed with a CUDA mask in the
KV cache's prefill). Here the code runs with the model and the batches on the CPU while tensor
factories default to the meta device, so such a tensor becomes a meta tensor and the op that
mixes it with CPU tensors fails on the CPU the same way. Deliberate CPU tensors (the batch's
length tensors the trainer counts from on the host, the data loader's) say ``device="cpu"``.

Each case is one short job as the trainer runs it, on real corpus batches of varied lengths:
two microbatches of a training step (forward, loss, backward, clipping, the optimizer), the
sync step's read-back and cut counts, validation, then the evaluation of its checkpoint
(greedy decoding with the KV cache, batches of 4 padded utterances), decoding with and without
the cache, and decoding after text-only prompts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.harness.hf_tiny import save_tiny, save_tiny_encoder
from tests.harness.training import trainer_in_process
from train.data.prompt import load_tokenizer, text_prompt
from train.eval.decode import greedy_decode, greedy_decode_text
from train.evaluate import EvaluateConfig, Evaluation
from train.evaluate import preflight as evaluate_preflight
from train.metrics import MetricsLogger
from train.trainer import Trainer

CPU = torch.device("cpu")
MAX_NEW_TOKENS = 4
QUESTIONS = ("Hi.", "What is said in this recording?")
# Overrides of each case; {whisper} and {qwen2} are the tiny Hugging Face models' folders.
CASES = {
    "tiny": [],
    "lora": ["model.lora.rank=4"],
    "tiny_moe": ["model=tiny_moe"],
    "hf_encoder": ["model.pretrained_encoder={whisper}"],
    "hf_encoder_cached": [
        "model.pretrained_encoder={whisper}",
        "model.freeze=[encoder\\..*]",
        "train.encoder_cache_mb=16",
    ],
    "hf_llm": ["model.pretrained_llm={qwen2}"],
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny random Whisper encoder and a tiny random Qwen2 decoder with its tokenizer."""
    root = tmp_path_factory.mktemp("hf")
    return {
        "whisper": save_tiny_encoder("whisper", root / "whisper"),
        "qwen2": save_tiny("qwen2", root / "qwen2"),
    }


def text_prompts(trainer: Trainer) -> list[list[int]]:
    """Text-only prompts of different lengths in the run's tokens: a pretrained LLM's chat
    prompts, or the byte tokenizer's bytes."""
    if trainer.cfg.model.pretrained_llm is None:
        return [list(question.encode()) for question in QUESTIONS]
    tokenizer = load_tokenizer(Path(trainer.cfg.model.pretrained_llm))
    return [text_prompt(tokenizer, question) for question in QUESTIONS]


@pytest.mark.parametrize("case", CASES)
def test_training_validation_and_decoding_make_every_tensor_on_its_device(
    case: str,
    corpus: Path,
    hf_models: dict[str, Path],
    one_rank_group: None,
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    overrides = [override.format(**hf_models) for override in CASES[case]]
    trainer = trainer_in_process(
        run_dir, corpus, "train.grad_accum=2", "eval.interval=1", *overrides
    )
    batches = trainer.data.batches()
    step = [next(batches), next(batches)]
    assert all(len(set(batch["feature_lens"].flatten().tolist())) > 1 for batch in step)
    metrics = MetricsLogger(
        run_dir, rank=0, run_id=None, config={}, total_steps=1, wandb_enabled=False
    )
    with torch.device("meta"):
        trainer.train_step(step)
        trainer.read_back(stop_flag=0.0)
        trainer.data.cut_counts(trainer.meshes.dp.get_group())
        trainer.validate(metrics)
    metrics.close()
    trainer.step += 1  # as the training loop counts it after a step
    trainer.save()

    cfg = EvaluateConfig(run_dir=str(run_dir), batch_size=4, max_new_tokens=MAX_NEW_TOKENS)
    evaluation = Evaluation(cfg, evaluate_preflight(cfg), CPU)
    model, prompt = evaluation.model, trainer.text.generation_prompt()
    never = frozenset({model.cfg.vocab_size})  # an id past the head: every step runs
    features, feature_lens = step[1]["features"], step[1]["feature_lens"]
    with torch.device("meta"):
        summary = evaluation.run()
        decoded = {
            use_cache: greedy_decode(
                model,
                features,
                feature_lens,
                MAX_NEW_TOKENS,
                evaluation.any_active,
                use_cache=use_cache,
                prompt=prompt,
                eos_ids=never,
            )
            for use_cache in (True, False)
        }
        answers = greedy_decode_text(
            model, text_prompts(trainer), MAX_NEW_TOKENS, evaluation.any_active, never
        )
    assert summary is not None and summary["num_utterances"] > 4, summary
    assert all(len(ids) == MAX_NEW_TOKENS for rows in decoded.values() for ids in rows)
    assert [len(ids) for ids in answers] == [MAX_NEW_TOKENS] * len(QUESTIONS)
