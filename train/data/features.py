"""Acoustic features of a cut, as the model's encoder expects them: (frames, bins) float32.

The project's own encoder reads 80-bin fbank (lhotse's ``Fbank``, as ``recipes/make_corpus.py``
stores it); a pretrained Hugging Face encoder reads what its own feature extractor computes
(Whisper's log-mel, Parakeet's normalized mel), never padded to a fixed length. A cut that
carries precomputed features of the right kind uses them; otherwise its audio is loaded (first
channel of several is not chosen: channels are averaged to mono), resampled to the extractor's
rate and featurized here, in a dataloader worker.

Every problem with one cut is a ``BadCut`` naming the cut and what is wrong; the data pipeline
decides whether that refuses the run or skips the cut (``train.data.sources``).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from lhotse import Fbank, FbankConfig
from lhotse.cut import Cut

from train.data.conversation_cuts import audio_segments

FBANK_BINS = 80  # the corpus's features (recipes/make_corpus.py) and the own encoder's input
OWN_RATE = 16000
FBANK_HOP_S = 0.01  # lhotse's fbank frame shift
PREPROCESSOR_FILE = "preprocessor_config.json"


class BadCut(ValueError):
    """A cut the pipeline cannot turn into an example; the message names cut and problem."""


@dataclass(frozen=True)
class Extractor:
    """How features are made: ``kind`` is "fbank" (the own encoder), "whisper" or "parakeet"
    (a pretrained encoder's extractor, loaded from ``directory``)."""

    kind: str = "fbank"
    directory: str | None = None

    @property
    def uses_stored(self) -> bool:
        """Whether a cut's precomputed features (the corpus's fbank) are what this needs."""
        return self.kind == "fbank"


def extractor_kind(directory: str | Path) -> str:
    """The extractor family named by a Hugging Face directory's preprocessor config."""
    path = Path(directory) / PREPROCESSOR_FILE
    if not path.is_file():
        raise ValueError(
            f"{directory}: no {PREPROCESSOR_FILE}; save the encoder's feature extractor beside it "
            "(feature_extractor.save_pretrained(DIR))"
        )
    name = json.loads(path.read_text()).get("feature_extractor_type", "")
    for kind in ("whisper", "parakeet"):
        if name.lower().startswith(kind):
            return kind
    raise ValueError(
        f"{directory}: feature extractor {name!r} is not supported (whisper, parakeet)"
    )


@dataclass(frozen=True)
class AudioLimits:
    """What audio an encoder can take: at least ``min_rate`` Hz (upsampling adds no bandwidth)
    and, for an encoder with a fixed position table (Whisper's 30 s), at most ``max_seconds``."""

    min_rate: int
    max_seconds: float | None = None


class Featurizer:
    """Computes one cut's features; built once per dataloader worker (the Hugging Face
    extractor is loaded lazily, so building it in the trainer costs nothing).

    With ``cache`` (a directory), features computed from audio are kept there as one ``.npy``
    per cut, named by the extractor and the cut's audio span, and read back when the cut comes
    again: later epochs and later jobs skip the computation. Files are written to a temporary
    name and renamed, so ranks and workers that compute the same cut at once never read a
    partial file.
    """

    def __init__(self, extractor: Extractor, cache: str | Path | None = None) -> None:
        self.extractor = extractor
        self.cache = None if cache is None else Path(cache)
        self._hf = None
        self._fbank = (
            Fbank(FbankConfig(num_filters=FBANK_BINS)) if extractor.kind == "fbank" else None
        )

    @property
    def hf(self):
        if self._hf is None:
            from transformers import AutoFeatureExtractor

            self._hf = AutoFeatureExtractor.from_pretrained(self.extractor.directory)
        return self._hf

    @property
    def bins(self) -> int:
        """Features per frame: what the encoder's input layer must take."""
        return FBANK_BINS if self._fbank is not None else int(self.hf.feature_size)

    def limits(self, enc_positions: int, enc_subsampling: int) -> AudioLimits:
        """The audio an encoder with ``enc_positions`` positions (0: any length) takes."""
        if not enc_positions:
            return AudioLimits(self.sampling_rate)
        return AudioLimits(self.sampling_rate, enc_positions * enc_subsampling * self.hop_s)

    @property
    def hop_s(self) -> float:
        """Seconds between feature frames."""
        return FBANK_HOP_S if self._fbank is not None else self.hf.hop_length / self.sampling_rate

    @property
    def sampling_rate(self) -> int:
        return OWN_RATE if self._fbank is not None else int(self.hf.sampling_rate)

    def __call__(self, cut: Cut) -> np.ndarray:
        """(frames, bins) float32 for ``cut``; ``BadCut`` when it cannot be made."""
        if self.extractor.uses_stored and cut.has_features:
            try:
                return np.asarray(cut.load_features(), dtype=np.float32)
            except Exception as error:  # any read failure is one bad cut
                raise BadCut(f"cut {cut.id}: its features cannot be read ({error})") from None
        cached = self.cached_path(cut)
        if cached is not None and cached.is_file():
            return np.load(cached)
        features = self.compute(self.audio(cut))
        if cached is not None:
            cached.parent.mkdir(parents=True, exist_ok=True)
            partial = cached.with_name(f".{cached.name}.{os.getpid()}.tmp")
            with partial.open("wb") as file:
                np.save(file, features)
            os.replace(partial, cached)
        return features

    def segments(self, cut: Cut) -> list[np.ndarray]:
        """The features of each of ``cut``'s audio segments, in order: a conversation's audio
        turns (none for one of text only), or a speech cut's audio."""
        return [self(segment) for segment in audio_segments(cut)]

    def compute(self, audio: np.ndarray) -> np.ndarray:
        if self._fbank is not None:
            return self._fbank.extract(audio, self.sampling_rate).astype(np.float32)
        return self.hf_features(audio)

    def cached_path(self, cut: Cut) -> Path | None:
        """Where ``cut``'s computed features are kept: the extractor, then a hash of the audio
        span (recording, channel, start, duration), so one recording's cuts never collide."""
        if self.cache is None:
            return None
        span = f"{cut.recording_id}|{cut.channel}|{cut.start:.5f}|{cut.duration:.5f}"
        extractor = f"{self.extractor.kind}|{self.extractor.directory or ''}"
        key = hashlib.sha256(f"{extractor}||{span}".encode()).hexdigest()
        return self.cache / self.extractor.kind / key[:2] / f"{key}.npy"

    def audio(self, cut: Cut) -> np.ndarray:
        """The cut's samples, mono, at the extractor's rate."""
        if not cut.has_recording:
            raise BadCut(f"cut {cut.id}: no features and no recording to compute them from")
        if cut.sampling_rate != self.sampling_rate:
            cut = cut.resample(self.sampling_rate)
        try:
            samples = cut.load_audio()
        except Exception as error:  # missing, corrupt, unreadable
            raise BadCut(f"cut {cut.id}: its audio cannot be read ({_short(error)})") from None
        if samples.ndim == 2:
            samples = samples.mean(axis=0)
        if samples.size == 0:
            raise BadCut(f"cut {cut.id}: its audio holds no samples")
        return samples.astype(np.float32)

    def hf_features(self, audio: np.ndarray) -> np.ndarray:
        """The Hugging Face extractor's features of one utterance at its own length."""
        out = self.hf(
            audio, sampling_rate=self.sampling_rate, padding="longest", return_tensors="np"
        )
        features = out["input_features"][0]
        if self.extractor.kind == "whisper":  # (bins, frames)
            features = features.T
        return np.ascontiguousarray(features, dtype=np.float32)


def _short(error: Exception) -> str:
    return str(error).splitlines()[0][:200] if str(error) else type(error).__name__


def extractor_of(pretrained_encoder: str | None) -> Extractor:
    """The extractor a model's encoder reads: its own fbank, or the pretrained encoder's."""
    if pretrained_encoder is None:
        return Extractor()
    return Extractor(extractor_kind(pretrained_encoder), str(Path(pretrained_encoder).resolve()))
