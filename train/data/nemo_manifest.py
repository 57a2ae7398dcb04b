"""NeMo's JSON-lines manifests as lhotse cuts, read as NeMo's ``LazyNeMoIterator`` reads them.

One line per utterance: ``audio_filepath`` and ``duration`` (required), ``text`` (the transcript;
its key is the entry's ``text_field``), ``offset`` (seconds into the file), ``lang`` (its
``lang_field``), ``sampling_rate`` (then the audio header is not read); every other key is
kept in ``cut.custom``; a line with a true ``_skipme`` is left out. A relative audio path is
looked up beside the manifest first, then in the current directory (NeMo's ``get_full_path``).
The cut's id is the audio file's stem, with ``-<offset>-<duration>`` in centiseconds after it
when the line has an offset (NeMo's ids). Files are read again on each pass: nothing is held.
"""

from __future__ import annotations

import gzip
import json
import re
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lhotse import Recording, SupervisionSegment
from lhotse.audio import AudioSource
from lhotse.cut import MonoCut
from lhotse.utils import compute_num_samples

from train.data.nemo_input_cfg import LANG_FIELD, TAR_SHARD, TEXT_FIELD

WHOLE_FILE_S = 0.2  # a line this close to its member's length is the whole member (NeMo's)
PLACEHOLDER_RATE = 16000  # a missing file's rate: the source check sets its cut aside by name


def audio_path(given: str, manifest: Path) -> Path:
    path = Path(given).expanduser()
    if path.is_absolute():
        return path
    beside = manifest.parent / path
    return beside if beside.exists() else path


def recording_of(audio: Path, rate: Any, seconds: float) -> Recording:
    """The recording of a manifest line: from the file's header, or without reading it when
    the line gives its rate (NeMo's way), or a placeholder for a missing file."""
    if rate is None and audio.is_file():
        return Recording.from_file(audio, recording_id=audio.stem)
    rate = int(rate or PLACEHOLDER_RATE)
    return Recording(
        id=audio.stem,
        sources=[AudioSource(type="file", channels=[0], source=str(audio))],
        sampling_rate=rate,
        num_samples=compute_num_samples(seconds, rate),
        duration=seconds,
    )


def nemo_cut(
    line: dict[str, Any], manifest: Path, text_field: str = TEXT_FIELD, lang_field: str = LANG_FIELD
) -> MonoCut:
    """The cut of one manifest line (module docstring); a line without audio_filepath or
    duration is a ValueError naming the manifest."""
    data, given, duration, offset = _fields(line, manifest)
    audio = audio_path(given, manifest)
    recording = recording_of(audio, data.pop("sampling_rate", None), offset + duration)
    return _cut(recording, recording.id, data, offset, duration, text_field, lang_field)


def _fields(line: dict[str, Any], manifest: Path) -> tuple[dict, str, float, float]:
    """(the line's other keys, audio_filepath, duration, offset)."""
    data = dict(line)
    try:
        given = str(data.pop("audio_filepath"))
        duration = float(data.pop("duration"))
    except KeyError as missing:
        raise ValueError(f"{manifest}: a line has no {missing} (NeMo manifests need it)") from None
    return data, given, duration, float(data.pop("offset", 0.0) or 0.0)


def _cut(
    recording: Recording,
    name: str,
    data: dict[str, Any],
    offset: float,
    duration: float,
    text_field: str,
    lang_field: str,
) -> MonoCut:
    """The cut of ``recording`` a line describes: named ``name``, with NeMo's offset suffix."""
    cut_id = name
    if offset:
        cut_id = f"{cut_id}-{round(offset * 100):06d}-{round(duration * 100):06d}"
    text, language = data.get(text_field), data.get(lang_field)
    supervision = SupervisionSegment(
        id=cut_id,
        recording_id=recording.id,
        start=0.0,
        duration=duration,
        channel=0,
        text=None if text is None else str(text),
        language=None if language is None else str(language),
    )
    return MonoCut(
        id=cut_id,
        start=offset,
        duration=duration,
        channel=0,
        recording=recording,
        supervisions=[supervision],
        custom=data or None,
    )


def json_lines(path: Path) -> Iterator[dict[str, Any]]:
    """A manifest's lines (``_skipme`` ones left out); a line that is not JSON names itself."""
    opener: Any = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as lines:
        for number, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            try:
                line = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not JSON ({error.msg})") from None
            if not line.get("_skipme"):
                yield line


class NemoManifestCuts:
    """The cuts of one or more manifests, one after another, read lazily on every pass."""

    def __init__(
        self, paths: tuple[Path, ...], text_field: str = TEXT_FIELD, lang_field: str = LANG_FIELD
    ) -> None:
        self.paths, self.text_field, self.lang_field = paths, text_field, lang_field

    def __iter__(self) -> Iterator[MonoCut]:
        for path in self.paths:
            for line in json_lines(path):
                yield nemo_cut(line, path, self.text_field, self.lang_field)


SUB_SUFFIX = re.compile(r"-sub\d+(?=\.[^./]+$)")  # NeMo's name for a file's repeated lines


class NemoTarredCuts:
    """The cuts of a tarred NeMo dataset, read as NeMo's ``LazyNeMoTarredIterator`` reads them:
    shard by shard, each tar as a stream, every member matched by name to its manifest lines
    (``-subN`` suffixes of repeated files stripped), each line a cut of the member's audio held
    in memory. ``metadata_only``: the cuts from the manifests alone, the tars unread (what the
    source check at a job's start walks), with the same ids.

    ``paths`` as ``train.data.nemo_input_cfg`` pairs them: each manifest shard then its tar
    (``sharded``), or one manifest then every tar (``single``: the lines' ``shard_id`` says
    which). A member no line names is an error naming both, as in NeMo."""

    def __init__(
        self,
        paths: tuple[Path, ...],
        layout: str,
        text_field: str = TEXT_FIELD,
        lang_field: str = LANG_FIELD,
        metadata_only: bool = False,
    ) -> None:
        self.paths, self.layout = paths, layout
        self.text_field, self.lang_field = text_field, lang_field
        self.metadata_only = metadata_only

    def shards(self) -> Iterator[tuple[Path, Path, list[dict[str, Any]]]]:
        """(manifest, tar, the shard's lines) in shard order."""
        if self.layout == "single":
            manifest, *tars = self.paths
            by_shard: dict[int, list] = {}
            for line in json_lines(manifest):
                by_shard.setdefault(int(line["shard_id"]), []).append(line)
            for tar in tars:
                match = TAR_SHARD.search(tar.name)
                assert match is not None  # checked when the entry was read
                yield manifest, tar, by_shard.get(int(match.group(1)), [])
            return
        for manifest, tar in zip(self.paths[::2], self.paths[1::2], strict=True):
            yield manifest, tar, list(json_lines(manifest))

    def __iter__(self) -> Iterator[MonoCut]:
        for manifest, tar, lines in self.shards():
            if self.metadata_only:
                for line in lines:
                    data, name, duration, offset = _fields(line, manifest)
                    rate = int(data.pop("sampling_rate", None) or PLACEHOLDER_RATE)
                    recording = Recording(
                        id=name,
                        sources=[AudioSource(type="memory", channels=[0], source=b"")],
                        sampling_rate=rate,
                        num_samples=compute_num_samples(offset + duration, rate),
                        duration=offset + duration,
                    )
                    yield _cut(recording, name, data, offset, duration, *self.fields)
                continue
            yield from self.read_tar(manifest, tar, lines)

    @property
    def fields(self) -> tuple[str, str]:
        return self.text_field, self.lang_field

    def read_tar(self, manifest: Path, tar: Path, lines: list[dict]) -> Iterator[MonoCut]:
        by_member: dict[str, list[dict]] = {}
        for line in lines:
            by_member.setdefault(SUB_SUFFIX.sub("", str(line["audio_filepath"])), []).append(line)
        with tarfile.open(tar, mode="r|*") as stream:
            for member in stream:
                if not member.isfile():
                    continue
                described = by_member.get(member.name)
                if described is None:
                    raise ValueError(
                        f"{tar}: member {member.name} has no line in {manifest}; the tar and its "
                        "manifest come from different conversions"
                    )
                handle = stream.extractfile(member)
                assert handle is not None
                recording = Recording.from_bytes(handle.read(), recording_id=member.name)
                for line in sorted(described, key=lambda d: str(d["audio_filepath"])):
                    data, name, duration, offset = _fields(line, manifest)
                    data.pop("sampling_rate", None)
                    if not offset and abs(duration - recording.duration) <= WHOLE_FILE_S:
                        duration = recording.duration  # the whole member, as NeMo takes it
                    yield _cut(recording, name, data, offset, duration, *self.fields)
