"""Training on the user's own sources: the weighted mixture, its seeds and exact resume, on-the-fly
features and bad data (the 2-rank training on a mixture: tests/test_own_data.py)."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from lhotse import CutSet, Fbank, FbankConfig, Recording
from lhotse.utils import fastcopy
from transformers import WhisperFeatureExtractor

from train.data.batch_hash import batch_hash
from train.data.features import AudioLimits, BadCut, Extractor, Featurizer
from train.data.loader import DataPosition, SpeechDataset, batches_from, build_dataloader, load_cuts
from train.data.source_cuts import check_sources, load_source_cuts, mixed_stream, problem, source_of
from train.data.sources import SourceError, read_sources
from train.data.text import ByteTokenizer

WEIGHTS = {"train": 0.7, "dev": 0.3}


def two_sources(corpus: Path, directory: Path) -> Path:
    """The corpus's train split (stored fbank) and its dev split as audio only (features computed
    in the workers), weighted 0.7 / 0.3."""
    audio_only = directory / "dev_audio.jsonl.gz"
    if not audio_only.exists():
        load_cuts(corpus / "cuts_dev.jsonl.gz").drop_features().to_file(audio_only)
    path = directory / "input_cfg.yaml"
    path.write_text(
        f"- {{name: train, cuts: {corpus / 'cuts_train.jsonl.gz'}, weight: {WEIGHTS['train']}}}\n"
        f"- {{name: dev, cuts: {audio_only}, weight: {WEIGHTS['dev']}}}\n"
    )
    return path


def checked(path: Path, max_duration: float | None = 8.0) -> list:
    return check_sources(
        read_sources(path, "data.input_cfg"), max_duration, AudioLimits(16000), print
    )


def loader(
    checks: list, dp_rank: int = 0, dp_size: int = 2, num_workers: int = 0, epoch_batches=5000
):
    return lambda epoch, position: build_dataloader(
        checks,
        max_duration=4.0,
        job_seed=11,
        dp_rank=dp_rank,
        dp_size=dp_size,
        num_workers=num_workers,
        text=ByteTokenizer(),
        buckets=2,
        epoch=epoch,
        position=position,
        mixture_epoch_batches=epoch_batches,
    )


def hashes(items, count: int) -> list[tuple[DataPosition, str]]:
    return [(position, batch_hash(batch)) for position, batch in itertools.islice(items, count)]


def test_the_mixture_draws_sources_by_weight(corpus, tmp_path):
    """lhotse's mux semantics: over many cuts each source's share is its weight, within three
    standard errors; so is a nested group's product of weights."""
    checks = checked(two_sources(corpus, tmp_path))
    cuts = list(itertools.islice(mixed_stream(checks, seed=5), 4000))
    counts = Counter(source_of(cut) for cut in cuts)
    for name, weight in WEIGHTS.items():
        error = 3 * math.sqrt(weight * (1 - weight) / len(cuts))
        assert abs(counts[name] / len(cuts) - weight) < error, counts
    nested = tmp_path / "nested.yaml"
    nested.write_text(
        f"- {{name: a, cuts: {corpus / 'cuts_train.jsonl.gz'}}}\n"
        f"- sources:\n"
        f"  - {{name: b, cuts: {corpus / 'cuts_dev.jsonl.gz'}, weight: 1}}\n"
        f"  - {{name: c, cuts: {corpus / 'cuts_test.jsonl.gz'}, weight: 3}}\n"
    )
    cuts = list(itertools.islice(mixed_stream(checked(nested), seed=5), 4000))
    counts = Counter(source_of(cut) for cut in cuts)
    for name, share in {"a": 0.5, "b": 0.125, "c": 0.375}.items():
        assert abs(counts[name] / len(cuts) - share) < 3 * math.sqrt(share * (1 - share) / 4000)


def test_mixed_batches_follow_the_seed_contract_and_resume_exactly(corpus, tmp_path):
    """Two data-parallel ranks read different batches at every step, a TP peer of rank 0 (same
    dp rank) the same ones; a job resumed from a saved position continues each rank's stream
    exactly, with features computed in a worker for the audio-only source."""
    checks = checked(two_sources(corpus, tmp_path))
    ranks = [
        hashes(batches_from(loader(checks, rank), DataPosition.start(1)), 8) for rank in (0, 1)
    ]
    assert all(a != b for (_, a), (_, b) in zip(*ranks, strict=True))
    assert hashes(batches_from(loader(checks, 0), DataPosition.start(1)), 8) == ranks[0]
    for rank, taken, workers in ((0, 3, 1), (1, 7, 0)):
        saved = json.loads(json.dumps(ranks[rank][taken - 1][0].state()))
        start, replay = DataPosition.resume(saved, 1)
        resumed = hashes(batches_from(loader(checks, rank, num_workers=workers), start, replay), 1)
        assert resumed == ranks[rank][taken : taken + 1], f"rank {rank} after {taken} batches"


def test_a_long_mixture_resumes_within_its_epoch(corpus, tmp_path):
    """The mixture is cut into epochs (their own seeds), so a job resumed weeks into a run
    re-draws one epoch's batches at most; across epoch boundaries the stream continues
    exactly, and each epoch draws a new order."""
    checks = checked(two_sources(corpus, tmp_path))
    read = loader(checks, 0, 1, epoch_batches=4)
    whole = hashes(batches_from(read, DataPosition.start(1)), 8)
    assert [position.epoch for position, _ in whole] == [0, 0, 0, 1, 1, 1, 1, 2]
    assert whole[3][0] == DataPosition.start(1, epoch=1)  # epoch 0 ends: the next starts
    assert [h for _, h in whole[:4]] != [h for _, h in whole[4:8]]
    for taken in (4, 6):
        saved = json.loads(json.dumps(whole[taken - 1][0].state()))
        start, replay = DataPosition.resume(saved, 1)
        assert hashes(batches_from(read, start, replay), 2) == whole[taken : taken + 2], taken


def test_features_computed_from_audio_equal_the_stored_ones(corpus, tmp_path):
    """The corpus stores lhotse's fbank of its wavs; computing it from the audio in a worker
    gives the same matrix (a source without features trains on what the corpus would hold),
    and the feature cache hands back exactly what it computed, without the audio."""
    cut = next(iter(load_cuts(corpus / "cuts_dev.jsonl.gz")))
    stored = Featurizer(Extractor())(cut)
    computed = Featurizer(Extractor())(cut.drop_features())
    expected = cut.compute_features(Fbank(FbankConfig(num_filters=80)))
    np.testing.assert_array_equal(computed, expected)
    np.testing.assert_allclose(stored, computed, atol=1e-4)
    cached = Featurizer(Extractor(), cache=tmp_path / "cache")
    np.testing.assert_array_equal(cached(cut.drop_features()), computed)
    [kept] = (tmp_path / "cache").rglob("*.npy")
    moved = fastcopy(
        cut.recording, sources=[fastcopy(cut.recording.sources[0], source=str(tmp_path / "gone"))]
    )
    np.testing.assert_array_equal(cached(fastcopy(cut.drop_features(), recording=moved)), computed)
    assert list((tmp_path / "cache").rglob("*")) and kept.is_file()


def sox(*args: str) -> None:
    subprocess.run(["sox", *args], check=True, capture_output=True)


@pytest.fixture
def bad_source(corpus, tmp_path) -> Path:
    """A source as users' data goes wrong: audio missing, corrupt or at 8 kHz, an empty
    transcript, a cut longer than the batch budget, beside good cuts."""
    good = list(load_cuts(corpus / "cuts_dev.jsonl.gz").drop_features())[:6]
    wav = Path(good[0].recording.sources[0].source)
    corrupt = tmp_path / "corrupt.wav"
    corrupt.write_bytes(wav.read_bytes()[:60] + b"\x00garbage" * 50)
    low = tmp_path / "low.wav"
    sox(str(wav), "-r", "8000", str(low))
    long = tmp_path / "long.wav"
    sox("-n", "-r", "16000", "-c", "1", str(long), "synth", "31", "sine", "440")

    def with_audio(cut, path: Path, name: str):
        recording = Recording.from_file(path, recording_id=name) if path.exists() else None
        recording = recording or fastcopy(
            cut.recording, id=name, sources=[fastcopy(cut.recording.sources[0], source=str(path))]
        )
        supervision = fastcopy(cut.supervisions[0], recording_id=name, duration=recording.duration)
        return fastcopy(
            cut,
            id=name,
            recording=recording,
            duration=recording.duration,
            supervisions=[supervision],
        )

    bad = [
        with_audio(good[1], tmp_path / "gone.wav", "missing-audio"),
        fastcopy(
            with_audio(good[2], wav, "corrupt-audio"),
            recording=fastcopy(
                Recording.from_file(wav, recording_id="corrupt-audio"),
                sources=[fastcopy(good[2].recording.sources[0], source=str(corrupt))],
            ),
        ),
        with_audio(good[3], low, "low-rate"),
        with_audio(good[4], long, "too-long"),
        fastcopy(
            good[5], id="empty-text", supervisions=[fastcopy(good[5].supervisions[0], text=" ")]
        ),
    ]
    path = tmp_path / "bad.jsonl.gz"
    CutSet.from_cuts([*good[:1], *bad]).to_file(path)
    return path


def test_bad_cuts_are_set_aside_at_start_or_skipped_in_the_worker(bad_source, tmp_path):
    """What the metadata shows is set aside at the start, one line per reason naming a cut; a
    corrupt file only shows when read: its batch goes on without it and names it."""
    lines: list[str] = []
    sources = read_sources([{"name": "mine", "cuts": str(bad_source)}], "data.input_cfg")
    [check] = check_sources(sources, 8.0, AudioLimits(16000), lines.append)
    assert check.excluded == {
        "missing-audio": "audio file missing",
        "low-rate": "audio at 8000 Hz, below the extractor's 16000 Hz",
        "too-long": "longer than the batch budget of 8 s",
        "empty-text": "empty transcript",
    }
    assert len(lines) == 4 and all(
        line.startswith("source mine: 1 cut(s) skipped") for line in lines
    )
    usable = [cut for cut in load_source_cuts(sources[0]) if cut.id not in check.excluded]
    batch = SpeechDataset(ByteTokenizer())[CutSet.from_cuts(usable)]
    assert batch["cut_ids"] == [usable[0].id]
    [skipped] = batch["skipped"]
    assert (
        skipped.startswith("cut corrupt-audio: its audio cannot be read")
        and "source mine" in skipped
    )
    with pytest.raises(BadCut, match="every cut of a batch is unusable"):
        SpeechDataset(ByteTokenizer())[CutSet.from_cuts(usable[1:])]


def test_a_source_with_nothing_usable_is_refused_before_training(bad_source, tmp_path):
    only_bad = tmp_path / "only_bad.jsonl.gz"
    CutSet.from_cuts(
        [cut for cut in CutSet.from_file(bad_source) if cut.id in ("empty-text", "too-long")]
    ).to_file(only_bad)
    sources = read_sources([{"name": "junk", "cuts": str(only_bad)}], "data.input_cfg")
    with pytest.raises(SourceError, match=r"source junk \(cuts: .*\) has no usable cuts"):
        check_sources(sources, 8.0, AudioLimits(16000), lambda line: None)


def test_cuts_longer_than_whisper_takes_are_set_aside(bad_source, tmp_path):
    """Whisper's position table holds 30 s: a 30-s-plus cut under a larger batch budget would
    stop the job when drawn, hours in; it is set aside at the start instead."""
    WhisperFeatureExtractor(feature_size=80).save_pretrained(tmp_path / "whisper")
    featurizer = Featurizer(Extractor("whisper", str(tmp_path / "whisper")))
    limits = featurizer.limits(enc_positions=1500, enc_subsampling=2)
    assert limits == AudioLimits(16000, 30.0)
    long = next(cut for cut in CutSet.from_file(bad_source) if cut.id == "too-long")
    assert long.duration > 30.0
    assert problem(long, 60.0, limits) == "longer than the encoder takes (30 s)"
    assert problem(long, 60.0, AudioLimits(16000)) is None


def test_a_shar_source_mixes_with_a_manifest(corpus, tiny_corpus, tmp_path):
    """A lhotse Shar directory as one source of the mixture: its cuts carry their features in
    the shards and come out in batches beside the manifest's."""
    path = tmp_path / "shar_mix.yaml"
    path.write_text(
        f"- {{name: streamed, shar: {tiny_corpus / 'shar' / 'train'}, weight: 1}}\n"
        f"- {{name: manifest, cuts: {corpus / 'cuts_dev.jsonl.gz'}, weight: 1}}\n"
    )
    checks = checked(path)
    assert checks[0].usable > 0
    batches = itertools.islice(batches_from(loader(checks, 0, 1), DataPosition.start(1)), 6)
    drawn = Counter(source for _, batch in batches for source in batch["sources"])
    assert drawn["streamed"] > 0 and drawn["manifest"] > 0, drawn


@pytest.mark.parametrize("family", ["whisper", "parakeet"])
def test_a_pretrained_extractor_computes_what_it_computes_alone(corpus, tmp_path, family):
    """The worker's features of a cut are the Hugging Face extractor's own output on the same
    audio (Whisper's transposed to frames x bins), at the utterance's length, not 30 s."""
    from transformers import ParakeetFeatureExtractor

    extractor = WhisperFeatureExtractor(feature_size=80) if family == "whisper" else None
    extractor = extractor or ParakeetFeatureExtractor()
    extractor.save_pretrained(tmp_path / family)
    cut = next(iter(load_cuts(corpus / "cuts_dev.jsonl.gz"))).drop_features()
    audio = cut.load_audio()[0]
    alone = extractor(audio, sampling_rate=16000, padding="longest", return_tensors="np")
    expected = alone["input_features"][0]
    expected = expected.T if family == "whisper" else expected
    got = Featurizer(Extractor(family, str(tmp_path / family)))(cut)
    assert got.shape == expected.shape and got.shape[0] < 3000
    np.testing.assert_array_equal(got, expected)
