"""Features per dataloader worker: computed from audio against read from disk.

One process (one dataloader worker's share of a core), the same utterances of the LibriSpeech-
layout corpus (`make librispeech`: FLAC, 16 kHz) through each way a batch's features are made
(train/data/features.py): the own encoder's 80-bin fbank computed from the audio, Whisper's and
Parakeet's feature extractors (their default configs saved locally, nothing downloaded), and the
feature cache read back (``data.feature_cache``). The baseline is the cache read: what every
epoch after the first costs. Prints utterances per second per worker, ms per utterance and each
way's cost as a ratio to the baseline; compare utterances per second with the trainer's step
time (``step_time_s`` in metrics.jsonl) times the utterances per batch to see whether a rank's
workers keep up.

    python -m bench.bench_features [--manifests data/librispeech/manifests] [--utterances 200]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("OMP_NUM_THREADS", "1")


def timed(featurize, cuts) -> float:
    started = time.perf_counter()
    for cut in cuts:
        featurize(cut)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifests", default="data/librispeech/manifests", type=Path)
    parser.add_argument("--utterances", type=int, default=200)
    args = parser.parse_args()

    import torch
    from lhotse import CutSet, RecordingSet, SupervisionSet
    from transformers import ParakeetFeatureExtractor, WhisperFeatureExtractor

    from train.data.features import Extractor, Featurizer

    torch.set_num_threads(1)
    part = "train-clean-100"
    recordings = args.manifests / f"librispeech_recordings_{part}.jsonl.gz"
    if not recordings.exists():
        sys.exit(f"bench_features: {recordings} is missing; run `make librispeech` first")
    cuts = CutSet.from_manifests(
        recordings=RecordingSet.from_file(recordings),
        supervisions=SupervisionSet.from_file(
            args.manifests / f"librispeech_supervisions_{part}.jsonl.gz"
        ),
    ).subset(first=args.utterances)
    cuts = list(cuts)
    seconds_of_audio = sum(cut.duration for cut in cuts)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        WhisperFeatureExtractor(feature_size=80).save_pretrained(scratch / "whisper")
        ParakeetFeatureExtractor().save_pretrained(scratch / "parakeet")
        cached = Featurizer(Extractor(), cache=scratch / "cache")
        timed(cached, cuts)  # fills the cache
        ways = {
            "feature cache read (baseline)": cached,
            "fbank from audio (own encoder)": Featurizer(Extractor()),
            "Whisper extractor from audio": Featurizer(
                Extractor("whisper", str(scratch / "whisper"))
            ),
            "Parakeet extractor from audio": Featurizer(
                Extractor("parakeet", str(scratch / "parakeet"))
            ),
        }
        for featurize in ways.values():  # warm: imports, lazily loaded extractors
            featurize(cuts[0])
        results = {name: timed(featurize, cuts) for name, featurize in ways.items()}
    print(
        f"bench_features: {len(cuts)} utterances ({seconds_of_audio / len(cuts):.2f} s mean), "
        "one process, one thread"
    )
    baseline = results["feature cache read (baseline)"]
    for name, seconds in results.items():
        print(
            f"  {name:32s} {len(cuts) / seconds:8.1f} utt/s  {1000 * seconds / len(cuts):7.2f} "
            f"ms/utt  x{seconds / baseline:6.1f} the baseline"
        )


if __name__ == "__main__":
    main()
