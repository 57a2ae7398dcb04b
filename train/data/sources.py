"""The user's data sources: what ``data.input_cfg`` and ``eval.sets`` name, read and checked.

A source file is a YAML list; each entry is one of

    - cuts: PATH                  # a lhotse CutSet manifest (or a list of them)
    - shar: DIR                   # a lhotse Shar directory (cuts.*.jsonl.gz + data shards),
                                  #   or {cuts: [shard, ...], recording: [...], ...} by field
    - recordings: PATH            # the manifest pair lhotse's recipes write
      supervisions: PATH          #   (e.g. ``lhotse prepare librispeech``)
    - sources: [...]              # a group of entries, nested to any depth

or NeMo's ``input_cfg`` entries, as NeMo writes them (those with a ``type:`` key,
``train.data.nemo_input_cfg``: ``lhotse``, ``lhotse_shar``, ``nemo`` manifests, ``group``), read as
NeMo reads them,

with ``weight:`` (default 1), ``name:`` (default: the file's stem, or ``group<i>``) and ``tags:``
(a mapping; ``prompt`` and ``system`` shape a pretrained LLM's chat prompt, where ``{key}``
is replaced by the tag of that name, e.g. ``Transcribe the {language} audio``; every tag is
carried on the cut as ``cut.custom``). A group's tags are its members' defaults.

Weights are the probabilities of lhotse's mux: the next cut comes from a source with
probability ``weight / sum of its siblings' weights``; in a group the probabilities multiply
(a group of weight 0.5 with two members of weights 1 and 3 gives them 0.125 and 0.375 of the
cuts). A weight is a share of cuts, not of hours: a source of long cuts at equal weight gives
more audio. Relative paths are resolved against the source file's directory.

A cut manifest, a Shar directory or a recordings + supervisions pair may also be an
``s3://bucket/key`` location in object storage (``train.data.storage``: credentials from the
environment only), checked here with metadata requests and read as streams.

Everything here is torch-free: the submit path and the trainer's preflight read sources too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from train.data.conversation import CONVERSATIONS_KIND, TEXT_PAIRS_KIND
from train.data.nemo_input_cfg import (
    NEMO_KIND,
    NEMO_TARRED_KIND,
    NemoConfigError,
    is_nemo_entry,
    translate,
    validation_sets,
)
from train.data.storage import StorageError, check_location, is_url

# An entry's kind is the first of these keys it has (NeMo manifests only from a NeMo entry).
KINDS = ("cuts", "shar", "recordings", CONVERSATIONS_KIND, TEXT_PAIRS_KIND)
NEMO_KINDS = (NEMO_KIND, NEMO_TARRED_KIND)
GROUP = "sources"
READER = "reader"  # how a kind's files are read (a NeMo manifest's text and language fields)
QUESTIONS = "questions"  # a text_pairs source's file of questions put before each source line
KNOWN_KEYS = {
    *KINDS,
    *NEMO_KINDS,
    "supervisions",
    GROUP,
    "weight",
    "name",
    "tags",
    READER,
    QUESTIONS,
}
PROMPT_TAGS = ("prompt", "system")


@dataclass(frozen=True)
class Source:
    """One leaf source: where its cuts are, its share of the mixture and its tags."""

    name: str
    kind: str  # one of KINDS or NEMO_KINDS
    # cut manifests, one Shar dir, or (recordings, supervisions); a str is an s3:// URL
    paths: tuple[Path | str, ...]
    weight: float = 1.0  # the probability of drawing from it (the product down the groups)
    tags: Mapping[str, Any] = field(default_factory=dict)
    reader: Mapping[str, str] = field(default_factory=dict)  # READER: how its files are read
    # A Shar given shard by shard (``shar: {cuts: [...], recording: [...]}``, NeMo's shar_path
    # mapping): each field's shards in order; ``paths`` then holds its cut shards.
    shards: Mapping[str, tuple[Path | str, ...]] = field(default_factory=dict)

    def describe(self) -> str:
        return f"{self.name} ({self.kind}: {', '.join(str(p) for p in self.paths)})"


class SourceError(ValueError):
    """A source file or entry that cannot be used; the message names it and the fix."""


def read_sources(spec: str | Path | list | Mapping, where: str) -> list[Source]:
    """The leaf sources of a source file (``spec`` a path) or of an inline list; ``where`` names
    the setting in errors (``data.input_cfg``, ``eval.sets``)."""
    if isinstance(spec, (str, Path)):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise SourceError(f"{where}={spec}: no such file")
        try:
            entries = yaml.safe_load(path.read_text())
        except yaml.YAMLError as error:
            raise SourceError(f"{where}={spec}: not valid YAML ({_first_line(error)})") from None
        base, label = path.resolve().parent, f"{where}={spec}"
    else:
        entries, base, label = spec, Path.cwd(), where
    try:
        if isinstance(entries, Mapping):  # NeMo's validation_ds: {datasets: {name: ...}}
            entries = validation_sets(entries, label, Path.cwd())
        elif isinstance(entries, list) and any(is_nemo_entry(entry) for entry in entries):
            entries = translate(entries, label, Path.cwd())
    except NemoConfigError as error:
        raise SourceError(str(error)) from None
    if not isinstance(entries, list) or not entries:
        raise SourceError(f"{label}: expected a non-empty YAML list of sources")
    leaves = _entries(entries, base, label, 1.0, {}, "")
    names = [leaf.name for leaf in leaves]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise SourceError(
            f"{label}: source names repeat ({', '.join(repeated)}): give each a name:"
        )
    return leaves


def _entries(
    entries: list, base: Path, label: str, share: float, tags: Mapping[str, Any], prefix: str
) -> list[Source]:
    weights = [_weight(entry, label, index) for index, entry in enumerate(entries)]
    total = sum(weights)
    leaves: list[Source] = []
    for index, (entry, weight) in enumerate(zip(entries, weights, strict=True)):
        where = f"{label}: source {prefix}{index}"
        own_tags = entry.get("tags") or {}
        if not isinstance(own_tags, dict):
            raise SourceError(f"{where}: tags must be a mapping (key: value)")
        merged = {**tags, **own_tags}
        if GROUP in entry:
            members = entry[GROUP]
            if not isinstance(members, list) or not members:
                raise SourceError(f"{where}: {GROUP} must be a non-empty list")
            leaves += _entries(
                members, base, label, share * weight / total, merged, f"{prefix}{index}."
            )
            continue
        kind, paths, shards = _locate(entry, base, where)
        name = str(entry.get("name") or _default_name(paths[0]))
        reader = dict(entry.get(READER) or {})
        if QUESTIONS in entry:
            if kind != TEXT_PAIRS_KIND:
                raise SourceError(f"{where}: {QUESTIONS}: belongs to a {TEXT_PAIRS_KIND}: source")
            questions = _resolve(base, str(entry[QUESTIONS]))
            if not isinstance(questions, Path) or not questions.is_file():
                raise SourceError(f"{where}: {QUESTIONS}: {questions} is not a local file")
            reader[QUESTIONS] = str(questions)
        leaves.append(Source(name, kind, paths, share * weight / total, merged, reader, shards))
    return leaves


def _weight(entry: object, label: str, index: int) -> float:
    if not isinstance(entry, dict):
        raise SourceError(f"{label}: source {index} must be a mapping (cuts:, shar:, ...)")
    unknown = sorted(set(entry) - KNOWN_KEYS)
    if unknown:
        raise SourceError(
            f"{label}: source {index} has unknown keys {', '.join(unknown)}; known: "
            f"{', '.join(sorted(KNOWN_KEYS))}"
        )
    weight = entry.get("weight", 1.0)
    if not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        name = entry.get("name", index)
        raise SourceError(
            f"{label}: source {name} has weight {weight!r}; weights must be positive (remove the "
            "source instead of giving it weight 0)"
        )
    return float(weight)


def _locate(
    entry: dict, base: Path, where: str
) -> tuple[str, tuple[Path | str, ...], dict[str, tuple[Path | str, ...]]]:
    """The kind, resolved paths and (a Shar given shard by shard) shards of a leaf entry; every
    path must exist."""
    kinds = [kind for kind in (*KINDS, *NEMO_KINDS) if kind in entry]
    if len(kinds) != 1:
        raise SourceError(
            f"{where}: give exactly one of {', '.join(f'{kind}:' for kind in KINDS)} or {GROUP}:"
        )
    kind = kinds[0]
    if kind in ("cuts", CONVERSATIONS_KIND):
        given = entry[kind] if isinstance(entry[kind], list) else [entry[kind]]
    elif kind == TEXT_PAIRS_KIND:
        given = entry[kind]
        if not isinstance(given, list) or len(given) != 2:
            raise SourceError(f"{where}: {kind}: takes [source file, target file]")
    elif kind == "shar" and isinstance(entry["shar"], Mapping):
        return kind, *_shards(entry["shar"], base, where)
    elif kind == "shar":
        given = [entry["shar"]]
    elif kind in NEMO_KINDS:
        given = list(entry[kind])
    else:
        if "supervisions" not in entry:
            raise SourceError(f"{where}: recordings: needs its supervisions: manifest beside it")
        given = [entry["recordings"], entry["supervisions"]]
    paths = tuple(_resolve(base, str(path)) for path in given)
    for path in paths:
        if isinstance(path, str):
            _check_remote(path, kind, where)
        elif not path.exists():
            raise SourceError(f"{where}: {path} does not exist")
    return kind, paths, {}


def _shards(
    given: Mapping, base: Path, where: str
) -> tuple[tuple[Path | str, ...], dict[str, tuple[Path | str, ...]]]:
    """A Shar's fields, each a list of shards of the same length, ``cuts`` among them: its cut
    shards and every field's shards, resolved and checked (in object storage: the first
    shard of each field, which is enough to find a wrong bucket, prefix or key)."""
    lists = {str(name): value for name, value in given.items()}
    if "cuts" not in lists or any(
        not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value)
        for value in lists.values()
    ):
        raise SourceError(
            f"{where}: a Shar given by fields maps each field (cuts among them) to a non-empty "
            "list of its shards"
        )
    if len({len(value) for value in lists.values()}) != 1:
        counts = {name: len(value) for name, value in lists.items()}
        raise SourceError(f"{where}: the Shar's fields have different shard counts {counts}")
    shards = {name: tuple(_resolve(base, v) for v in value) for name, value in lists.items()}
    for value in shards.values():
        if isinstance(value[0], str):
            _check_remote(value[0], "cuts", where)
        missing = [path for path in value if isinstance(path, Path) and not path.exists()]
        if missing:
            raise SourceError(f"{where}: {missing[0]} does not exist")
    return shards["cuts"], shards


def _check_remote(url: str, kind: str, where: str) -> None:
    """An object-storage location: its kind must be one lhotse streams, and the store must
    answer for it (metadata only: nothing is downloaded)."""
    if kind not in ("cuts", "shar", "recordings"):
        raise SourceError(
            f"{where}: {url}: NeMo manifests and tars, conversations and text are read from "
            "local paths; keep them in object storage as a lhotse Shar (shar:) or a cut "
            "manifest (cuts:) instead"
        )
    try:
        check_location(url, prefix=kind == "shar")
    except StorageError as error:
        raise SourceError(f"{where}: {error}") from None


def _resolve(base: Path, path: str) -> Path | str:
    if is_url(path):
        return path
    resolved = Path(path).expanduser()
    return resolved if resolved.is_absolute() else base / resolved


def _default_name(path: Path | str) -> str:
    name = path.name if isinstance(path, Path) else path.rstrip("/").rsplit("/", 1)[-1]
    for suffix in (".gz", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name


def _first_line(error: Exception) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def prompt_of(tags: Mapping[str, Any], key: str, default: str | None) -> str | None:
    """The ``prompt`` or ``system`` text of a cut's tags (``{tag}`` filled in), else ``default``."""
    text = tags.get(key)
    if text is None:
        return default
    try:
        return str(text).format_map({k: v for k, v in tags.items() if k not in PROMPT_TAGS})
    except KeyError as missing:
        raise SourceError(
            f"tags: {key} {text!r} names tag {missing} that the source lacks"
        ) from None


def check_prompt_tags(sources: list[Source], pretrained_llm: str | None, where: str) -> None:
    """Prompt tags shape a chat template: refused for the byte tokenizer of the presets."""
    if pretrained_llm is not None:
        return
    for source in sources:
        tagged = [tag for tag in PROMPT_TAGS if tag in source.tags]
        if tagged:
            raise SourceError(
                f"{where}: source {source.name} has {'/'.join(tagged)} tags, which shape a "
                "pretrained LLM's chat prompt; set model.pretrained_llm or drop the tags"
            )


def shares(sources: Iterable[Source]) -> dict[str, float]:
    """Each source's probability of supplying the next cut (weights normalized to 1)."""
    sources = list(sources)
    total = sum(source.weight for source in sources)
    return {source.name: source.weight / total for source in sources}
