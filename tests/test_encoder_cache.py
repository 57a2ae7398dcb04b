"""train.encoder_cache_mb: a frozen encoder's outputs kept per utterance
(train/models/encoder_cache.py). The kept frames are the encoder's for that utterance alone, on
real features of the tiny preset's encoder and of the real Whisper tiny.en; a chain with the
cache resumes bitwise at FSDP2 over 2 ranks and trains as the uncached run does; a config the
cache cannot serve is refused before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from contract.run_dir import METRICS_FILE
from recipes.pretrained import WHISPER
from tests.harness.conversations import conversation_mixture
from tests.harness.models import final_model, pretrained_model
from tests.harness.process import run_module
from train.config import (
    ConfigError,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    TrainLoopConfig,
)
from train.data.features import Featurizer, extractor_of
from train.data.loader import SpeechDataset, load_cuts
from train.data.text import ByteTokenizer
from train.models.build import build_model, encoder_replica
from train.models.encoder_cache import EncoderCache, encoder_keys
from train.models.hf_weights import load_encoder_weights
from train.parallel.layout import model_of, training_layout

FROZEN_ENCODER = "model.freeze=[encoder\\..*]"
CACHE = "train.encoder_cache_mb=64"


def model_and_batch(corpus: Path, pretrained_encoder: str | None, cuts: int = 6):
    """A single-process model with the encoder's real weights (the tiny preset's own at its
    init, or Whisper tiny.en's), and a batch of ``cuts`` corpus utterances of varying lengths
    as the data pipeline makes it for that encoder."""
    shape = model_of(ModelConfig(pretrained_encoder=pretrained_encoder, projector_stride=2))
    model = build_model(shape, torch.device("cpu"), init_seed=3)
    if pretrained_encoder is not None:
        load_encoder_weights(model, Path(pretrained_encoder))
    chosen = load_cuts(corpus / "cuts_train.jsonl.gz").subset(first=cuts)
    dataset = SpeechDataset(ByteTokenizer(), Featurizer(extractor_of(pretrained_encoder)))
    batch = dataset[chosen]
    features, lens = batch["features"][:, 0], batch["feature_lens"][:, 0]  # one segment each
    assert len(set(lens.tolist())) > 1, "the batch needs varying lengths"
    return model, features, lens


@pytest.mark.parametrize("encoder", ["own", "whisper"])
def test_kept_frames_are_each_utterance_encoded_alone(corpus, encoder) -> None:
    """Each example's frames are bitwise the encoder's on that utterance alone (whatever its
    batch-mates), within 1e-4 of the padded batch's (rounding: up to 1.0e-5 measured for
    Whisper), zero past its length; a second lookup answers from the cache with the same
    tensors; changed features are a new key."""
    directory = None if encoder == "own" else str(pretrained_model(WHISPER.name))
    model, features, lens = model_and_batch(corpus, directory)
    replica = encoder_replica(model, torch.device("cpu"), torch.float32)
    cache = EncoderCache(replica, model.cfg, max_bytes=2**30)
    keys = encoder_keys(features, lens)
    frames, frame_lens = cache.encode(keys, features, lens)
    assert cache.misses == len(lens) and cache.hits == 0
    with torch.no_grad():
        batched, batched_lens = model.encoder.eval()(features, lens)
        assert torch.equal(frame_lens, batched_lens)
        for index, length in enumerate(lens.tolist()):
            alone, _ = model.encoder(features[index : index + 1, :length], lens[index : index + 1])
            n = int(frame_lens[index])
            assert torch.equal(frames[index, :n], alone[0, :n]), index
            assert not frames[index, n:].any()
            scale = alone.abs().max()
            assert (frames[index, :n] - batched[index, :n]).abs().max() <= 1e-4 * scale

    again, _ = cache.encode(
        encoder_keys(features.flip(0), lens.flip(0)), features.flip(0), lens.flip(0)
    )
    assert cache.hits == len(lens) and torch.equal(again.flip(0)[:, : frames.shape[1]], frames)
    changed = features.clone()
    changed[0, 0, 0] += 1.0
    assert encoder_keys(changed, lens).digests[0] != keys.digests[0]
    assert encoder_keys(changed, lens).digests[1:] == keys.digests[1:]
    assert f"{len(lens)} utterances" in cache.describe()


def test_past_its_bound_the_cache_keeps_nothing_more_and_still_encodes(corpus) -> None:
    model, features, lens = model_and_batch(corpus, None)
    replica = encoder_replica(model, torch.device("cpu"), torch.float32)
    unbounded = EncoderCache(replica, model.cfg, max_bytes=2**30)
    expected, _ = unbounded.encode(encoder_keys(features, lens), features, lens)
    first = unbounded.frames[encoder_keys(features, lens).digests[0]]
    bounded = EncoderCache(replica, model.cfg, max_bytes=first.numel() * first.element_size())
    for _ in range(2):
        got, _ = bounded.encode(encoder_keys(features, lens), features, lens)
        assert torch.equal(got, expected)
    assert len(bounded.frames) == 1 and bounded.hits == 1
    assert bounded.misses == 2 * len(lens) - 1


def test_a_bf16_replica_gives_bf16_frames_from_bf16_features(corpus) -> None:
    """Under FSDP's bf16 parameters (CUDA) the features reach the encoder in bf16: the replica
    computes in bf16 and its frames feed the bf16 projector."""
    model, features, lens = model_and_batch(corpus, None)
    replica = encoder_replica(model, torch.device("cpu"), torch.bfloat16)
    assert {p.dtype for p in replica.parameters()} == {torch.bfloat16}
    cache = EncoderCache(replica, model.cfg, max_bytes=2**30)
    frames, frame_lens = cache.encode(
        encoder_keys(features, lens), features.to(torch.bfloat16), lens
    )
    assert frames.dtype == torch.bfloat16
    out, _ = model.projector.to(torch.bfloat16)(frames, frame_lens)
    assert torch.isfinite(out).all()


def cache_config(corpus: Path, **train) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(freeze=["encoder\\..*"]),
        data=DataConfig(corpus=str(corpus)),
        train=TrainLoopConfig(encoder_cache_mb=64, **train),
    )


def test_a_cache_of_a_training_encoder_or_under_a_pipeline_is_one_error_line(corpus) -> None:
    training_layout(cache_config(corpus), world_size=2)  # frozen, no pipeline: accepted
    unfrozen = cache_config(corpus)
    unfrozen.model.freeze = []
    with pytest.raises(ConfigError, match=r"encoder tensors train .*model.freeze") as error:
        training_layout(unfrozen, world_size=2)
    piped = cache_config(corpus)
    piped.parallel = ParallelConfig(pp=2)
    with pytest.raises(ConfigError, match="without pipeline parallelism") as piped_error:
        training_layout(piped, world_size=2)
    negative = cache_config(corpus)
    negative.train.encoder_cache_mb = -1
    with pytest.raises(ConfigError, match="encoder_cache_mb must be 0"):
        training_layout(negative, world_size=1)
    assert "\n" not in str(error.value) + str(piped_error.value)


def run(run_dir: Path, corpus: Path, *overrides: str, nproc: int = 2):
    return run_module(
        "train",
        "--config-name",
        "tiny_fsdp2",
        f"run_dir={run_dir}",
        f"data.corpus={corpus}",
        "data.max_duration=8",
        "optim.warmup_steps=2",
        "train.log_every=1",
        *overrides,
        nproc=nproc,
    )


def losses(run_dir: Path) -> list[float]:
    lines = (run_dir / METRICS_FILE).read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r]


STEPS = 16


def test_a_chain_with_the_cache_resumes_bitwise_and_trains_as_without_it(corpus, tmp_path):
    """Two jobs of 8 steps at FSDP2 over 2 ranks, each job's cache starting empty, end bitwise
    where one job of 16 ends; the epochs repeat utterances, and the cache answered them; the
    losses are those of the same run encoding every batch (the frames differ from the padded
    batch's by rounding only)."""
    common = (FROZEN_ENCODER, CACHE, f"train.max_steps={STEPS}", "eval.interval=4")
    chain = tmp_path / "chain"
    for _ in range(2):
        result = run(chain, corpus, *common, "train.max_steps_per_run=8")
        assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stderr
    alone = tmp_path / "alone"
    result = run(alone, corpus, *common)
    assert result.returncode == 0, result.stderr[-3000:]
    [line] = [x for x in result.stderr.splitlines() if "encoder cache:" in x]
    assert " 0.0% of" not in line, line
    chained, one_job = final_model(chain), final_model(alone)
    assert chained.keys() == one_job.keys()
    for name, weight in one_job.items():
        assert torch.equal(chained[name], weight), name

    uncached = tmp_path / "uncached"
    result = run(uncached, corpus, FROZEN_ENCODER, f"train.max_steps={STEPS}", "eval.interval=4")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "encoder cache" not in result.stderr
    assert losses(uncached) == pytest.approx(losses(alone), rel=1e-4)


def test_ranks_whose_batches_hold_no_audio_reduce_as_the_others_do(corpus, tmp_path):
    """Speech, conversations and text mixed at FSDP2 over 2 ranks with the frozen encoder's
    outputs kept: a step where one rank's batch is text alone still gives the projector a
    (zero) gradient there, so both ranks reduce-scatter it; without, that rank skipped the
    reduction and the other's waited on a mismatched collective (gloo: "Received data size
    doesn't match expected size", the real speech chat's second step). Losses as uncached."""
    mixture, sets = conversation_mixture(corpus, tmp_path / "data")
    # Mostly text, so that in most steps one rank's batch holds no audio while the other's does.
    sources = yaml.safe_load(mixture.read_text())
    for source in sources:
        source["weight"] = {"asr": 0.1, "spoken": 0.05, "text": 0.85}[source["name"]]
    mixture.write_text(yaml.safe_dump(sources))
    common = (FROZEN_ENCODER, f"data.input_cfg={mixture}", f"eval.sets={sets}", "train.max_steps=8")
    common += ("eval.interval=0", "seed=4")
    cached, uncached = tmp_path / "cached", tmp_path / "uncached"
    result = run(cached, corpus, *common, CACHE)
    assert result.returncode == 0, result.stderr[-3000:]
    drawn = [json.loads(line) for line in (cached / METRICS_FILE).read_text().splitlines()]
    assert sum(row.get("cuts/text", 0) for row in drawn) > 0
    result = run(uncached, corpus, *common)
    assert result.returncode == 0, result.stderr[-3000:]
    assert losses(cached) == pytest.approx(losses(uncached), rel=1e-4)


def test_the_trainer_refuses_a_cache_of_an_encoder_that_trains(corpus, tmp_path) -> None:
    result = run(tmp_path / "run", corpus, CACHE, nproc=1)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "train.encoder_cache_mb=64" in errors[0], result.stderr[-2000:]
