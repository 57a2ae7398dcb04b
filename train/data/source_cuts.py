"""The cuts of the sources ``train.data.sources`` reads: loaded with lhotse, checked once at the
start of a job, and mixed by weight into one endless stream (``train.data.loader`` cuts it into
epochs).

Checking (``check_sources``) walks every source's cut metadata once (no audio is read) and
sets aside, with one line per source and reason, the cuts no batch can use: an empty
transcript, a cut longer than the batch budget, audio at a lower sampling rate than the
encoder's extractor takes (upsampling adds no bandwidth: resample such a source yourself), a
recording whose audio file is missing. A source left with no usable cut stops the job before it
starts (a silent change of the mixture would be worse). What goes wrong later, in a worker
(a corrupt audio file), is skipped there and counted in the metrics (``train.data.loader``).

Mixing (``mixed_stream``): each source is an endless stream of its usable cuts, every pass
reshuffled (lhotse's streaming shuffle, seeded by (seed, source, pass)); lhotse's mux draws the
next cut from source ``i`` with probability ``weight_i`` (weights normalized to 1). Everything
is a pure function of the seed, so a sampler over the stream re-draws exactly the same batches
when a job resumes (``train.data.loader.fast_forward``) and every data-parallel rank sees the same
stream (each keeps its own share of the batches).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from lhotse import CutSet, RecordingSet, SupervisionSet
from lhotse.cut import Cut
from lhotse.lazy import LazyIteratorMultiplexer
from lhotse.utils import streaming_shuffle

from train.data.conversation import (
    CONVERSATIONS_KIND,
    TEXT_PAIRS_KIND,
    ConversationError,
    answer,
    conversation_of,
    messages,
)
from train.data.conversation_cuts import ConversationCuts, TextPairCuts, turn_recordings
from train.data.features import AudioLimits
from train.data.nemo_input_cfg import NEMO_KIND, NEMO_TARRED_KIND
from train.data.nemo_manifest import NemoManifestCuts, NemoTarredCuts
from train.data.sources import Source, SourceError
from train.data.storage import shar_shards

SHUFFLE_BUFFER = 10_000  # cuts held by each source's streaming shuffle
TAGS_KEY, SOURCE_KEY = "tags", "source"  # where a cut carries its source's tags and name


def load_source_cuts(source: Source, metadata_only: bool = False) -> CutSet:
    """The cuts of one source, lazily where lhotse can, each carrying its source's name and tags
    (``cut.custom``). A local cut manifest's relative paths resolve against its own directory
    (one in object storage names its audio by absolute path or URL). ``metadata_only``: a Shar's
    cuts from its cut shards, a tarred NeMo source's from its manifests, no audio shard read."""
    first = source.paths[0]
    if source.kind == "cuts":
        cuts = CutSet.from_jsonl_lazy(first) if len(source.paths) == 1 else None
        if cuts is None:
            cuts = CutSet.from_files([str(path) for path in source.paths])
        if isinstance(first, Path):
            parent = first.parent
            cuts = cuts.with_features_path_prefix(parent).with_recording_path_prefix(parent)
    elif source.kind == "shar":
        fields = dict(source.shards) or shar_shards(first)
        cuts = CutSet.from_shar(fields={"cuts": fields["cuts"]} if metadata_only else fields)
    elif source.kind == NEMO_KIND:
        cuts = CutSet(NemoManifestCuts(source.paths, **source.reader))
    elif source.kind == NEMO_TARRED_KIND:
        cuts = CutSet(NemoTarredCuts(source.paths, **source.reader, metadata_only=metadata_only))
    elif source.kind == CONVERSATIONS_KIND:
        cuts = CutSet(ConversationCuts(source.paths, **source.reader))
    elif source.kind == TEXT_PAIRS_KIND:
        cuts = CutSet(TextPairCuts(source.paths, **source.reader))
    else:
        recordings = RecordingSet.from_file(source.paths[0])
        supervisions = SupervisionSet.from_file(source.paths[1])
        cuts = CutSet.from_manifests(recordings=recordings, supervisions=supervisions)
    return cuts.map(_Tagger(source.name, dict(source.tags)))


@dataclass
class _Tagger:
    """Puts a source's name and tags on each of its cuts (a picklable map function)."""

    name: str
    tags: dict

    def __call__(self, cut: Cut) -> Cut:
        custom = dict(cut.custom or {})
        custom.update({SOURCE_KEY: self.name, TAGS_KEY: self.tags})
        cut.custom = custom
        return cut


def source_of(cut: Cut) -> str:
    return (cut.custom or {}).get(SOURCE_KEY, "")


def tags_of(cut: Cut) -> dict:
    return (cut.custom or {}).get(TAGS_KEY, {})


def transcript(cut: Cut) -> str:
    """What the model learns to write for ``cut``: its supervisions' text, or a conversation's
    last assistant turn (``train.data.conversation``)."""
    turns = conversation_of(cut.custom)
    if turns is not None:
        return answer(turns)
    return " ".join((s.text or "").strip() for s in cut.supervisions).strip()


@dataclass
class SourceCheck:
    """What ``check_sources`` found in one source."""

    source: Source
    usable: int = 0
    seconds: float = 0.0
    excluded: dict[str, str] = field(default_factory=dict)  # cut id -> reason
    reasons: Counter = field(default_factory=Counter)

    def lines(self) -> list[str]:
        """One line per reason cuts were set aside, with an example cut."""
        lines = []
        for reason, count in sorted(self.reasons.items()):
            example = next(cut for cut, why in self.excluded.items() if why == reason)
            lines.append(
                f"source {self.source.name}: {count} cut(s) skipped: {reason} (e.g. {example})"
            )
        return lines


def problem(cut: Cut, max_duration: float | None, limits: AudioLimits) -> str | None:
    """Why no batch can use ``cut`` (from its metadata and whether its files exist), or None."""
    try:
        turns = conversation_of(cut.custom)
        merged = None if turns is None else messages(turns)
    except ConversationError as error:
        return str(error)
    # A conversation's answer is its last message (messages() checked it), read once here.
    if not (transcript(cut) if merged is None else merged[-1].text):
        return "empty transcript"
    audio_turns = 0 if merged is None else sum(message.audio_turns for message in merged)
    if max_duration is not None and cut.duration > max_duration:
        return f"longer than the batch budget of {max_duration:g} s"
    recordings = turn_recordings(cut)
    if recordings is None:  # a speech cut: its audio unless it has features
        if not cut.has_recording and not cut.has_features:
            return "neither audio nor features"
        recordings = [cut.recording] if not cut.has_features else []
        if limits.max_seconds is not None and cut.duration > limits.max_seconds:
            return f"longer than the encoder takes ({limits.max_seconds:g} s)"
    elif len(recordings) != audio_turns:
        return f"{audio_turns} audio turns but {len(recordings)} recordings"
    for recording in recordings:
        if limits.max_seconds is not None and recording.duration > limits.max_seconds:
            return f"an audio turn longer than the encoder takes ({limits.max_seconds:g} s)"
        if recording.sampling_rate < limits.min_rate:
            return (
                f"audio at {recording.sampling_rate} Hz, below the extractor's {limits.min_rate} Hz"
            )
        for audio in recording.sources:
            if audio.type == "file" and not Path(audio.source).is_file():
                return "audio file missing"
    return None


def check_sources(
    sources: list[Source],
    max_duration: float | None,
    limits: AudioLimits,
    say: Callable[[str], None],
) -> list[SourceCheck]:
    """Walk every source's cuts once; report what is set aside; refuse a source with none left."""
    checks = []
    for source in sources:
        check = SourceCheck(source)
        try:
            cuts = load_source_cuts(source, metadata_only=True)
            for cut in cuts:
                reason = problem(cut, max_duration, limits)
                if reason is None:
                    check.usable += 1
                    check.seconds += cut.duration
                else:
                    check.excluded[cut.id] = reason
                    check.reasons[reason] += 1
        except Exception as error:  # an unreadable manifest: name the source
            raise SourceError(f"source {source.describe()}: cannot be read ({error})") from None
        for line in check.lines():
            say(line)
        if check.usable == 0:
            raise SourceError(
                f"source {source.describe()} has no usable cuts "
                f"({dict(check.reasons) or 'it is empty'}); fix or remove it"
            )
        checks.append(check)
    return checks


class SourceStream:
    """The usable cuts of one source, pass after pass, each pass reshuffled from
    (seed, source index, pass)."""

    def __init__(self, cuts: CutSet, excluded: frozenset[str], seed: int, index: int) -> None:
        self.cuts, self.excluded, self.seed, self.index = cuts, excluded, seed, index

    def __iter__(self) -> Iterator[Cut]:
        passes = 0
        while True:
            state = np.random.SeedSequence([self.seed, self.index, passes]).generate_state(1)
            rng = random.Random(int(state[0]))
            usable = (cut for cut in self.cuts if cut.id not in self.excluded)
            yield from streaming_shuffle(usable, bufsize=SHUFFLE_BUFFER, rng=rng)
            passes += 1


def mixed_stream(checks: list[SourceCheck], seed: int, durations_only: bool = False) -> CutSet:
    """An endless CutSet mixing the checked sources by weight (module docstring).
    ``durations_only``: the same cuts in the same order, for their durations: a Shar's from its
    cut shards alone, its audio shards unread (a tarred NeMo source's manifests need not follow
    its tars' order, so it is read whole)."""
    streams = [
        SourceStream(
            load_source_cuts(check.source, durations_only and check.source.kind == "shar"),
            frozenset(check.excluded),
            seed,
            index,
        )
        for index, check in enumerate(checks)
    ]
    if len(streams) == 1:
        return CutSet(streams[0])
    weights = [check.source.weight for check in checks]
    return CutSet(LazyIteratorMultiplexer(*streams, weights=weights, seed=seed))
