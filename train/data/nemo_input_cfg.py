"""NeMo's ``input_cfg`` entries, read as NeMo reads them, turned into this project's source
entries (``train.data.sources``).

A NeMo speechlm2 user's data config is a list of entries with a ``type``
(``nemo/collections/common/data/lhotse/cutset.py``); an entry of ``data.input_cfg`` with a
``type:`` key is read here, one without is the project's own format. Supported:

- ``type: lhotse`` or ``lhotse_shar``: ``cuts_path`` (a lhotse cut manifest) or ``shar_path``
  (a Shar directory; a list of them, each weighted by its number of cuts as NeMo weights them; or
  a list of ``[directory, weight]`` pairs). As in NeMo, ``shar_path`` decides, not the type name.
- ``type: nemo``: ``manifest_filepath``, NeMo's JSON-lines manifests (``audio_filepath``,
  ``duration``, optional ``text``, ``offset``, ``lang``, ``sampling_rate``; other keys are
  kept on the cut). A string may name many files with NeMo's brace syntax (``_OP_0..3_CL_``,
  ``{0..3}``), read one after another as one source; a list of files, or of ``[file, weight]``
  pairs, is a weighted group (a file's weight: its number of lines, as NeMo's). ``text_field``
  and ``lang_field`` name the keys that hold the transcript and the language.
- ``type: nemo_tarred`` (or ``nemo`` with ``tarred_audio_filepaths``; NeMo's docs write the
  singular ``tarred_audio_filepath``, taken too): manifests and tar shards as NeMo's
  ``convert_to_tarred_audio_dataset.py`` writes them, ``manifest__OP_0..N_CL_.json`` beside
  ``audio__OP_0..N_CL_.tar`` paired by the number in their names (or one manifest whose lines
  carry ``shard_id``); members matched to lines by name (``train.data.nemo_manifest``).
- ``type: group``: a nested ``input_cfg`` (a list, or a YAML file of one).
- ``type: multimodal_conversation``, ``share_gpt`` (``manifest_filepath``; ShareGPT's
  ``audio_placeholders``) and ``nemo_sft_jsonl`` (``paths``): JSON-lines conversations, read by
  ``train.data.conversation_cuts``; ``tags.system_prompt`` is the system text of conversations
  without one. ``type: txt_pair`` (``source_paths``, ``target_paths``, ``questions_path``):
  text pairs. Their ``audio_locator_tag`` (the trainer places audio itself),
  ``token_equivalent_duration`` (a text's share of the batch budget comes from its characters)
  and ``*_language`` keys are accepted and have no effect.
- on every entry: ``weight`` (all entries of a list, or none: equal shares), ``tags`` (a
  mapping put on each cut; a group's tags override its members', as NeMo applies them last).

Keys whose work the trainer does its own way are accepted and have no effect: ``shuffle``,
``shard_seed`` (every source is shuffled each pass from the job's seed, ``train.seeding``),
``max_open_streams`` and ``force_finite`` (each source is an endless stream, mixed by weight).
Any other key or type is refused in one line naming what is supported. A source is named by its
path as the entry gives it (NeMo entries have no names). Paths resolve against
the current directory, as NeMo resolves them (a job starts in the directory it was launched
from, or the code snapshot's copy of it); audio paths in a manifest against the manifest's own
directory first.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from train.data.conversation import CONVERSATIONS_KIND, TEXT_PAIRS_KIND
from train.data.storage import is_url

TYPE = "type"
# Tarred audio: NeMo reads the plural; its docs write the singular, which NeMo ignores (the
# entry is then read as untarred); both are taken here.
TARRED_KEYS = ("tarred_audio_filepaths", "tarred_audio_filepath")
# NeMo's types this reader takes, and the keys each may have besides the common ones.
TYPE_KEYS: dict[str, frozenset[str]] = {
    "lhotse": frozenset({"cuts_path", "shar_path"}),
    "lhotse_shar": frozenset({"cuts_path", "shar_path"}),
    "nemo": frozenset({"manifest_filepath", "text_field", "lang_field", *TARRED_KEYS}),
    "nemo_tarred": frozenset({"manifest_filepath", "text_field", "lang_field", *TARRED_KEYS}),
    "group": frozenset({"input_cfg"}),
    "multimodal_conversation": frozenset(
        {"manifest_filepath", "audio_locator_tag", "token_equivalent_duration"}
    ),
    "share_gpt": frozenset(
        {
            "manifest_filepath",
            "audio_locator_tag",
            "audio_placeholders",
            "token_equivalent_duration",
        }
    ),
    "nemo_sft_jsonl": frozenset({"paths", "language"}),
    "txt_pair": frozenset(
        {
            "source_paths",
            "target_paths",
            "questions_path",
            "source_language",
            "target_language",
            "questions_language",
        }
    ),
}
# The NeMo types whose examples are conversations or text (train.data.conversation_cuts reads them),
# and the key naming each one's JSON-lines files.
CONVERSATION_TYPES = {
    "multimodal_conversation": "manifest_filepath",
    "share_gpt": "manifest_filepath",
    "nemo_sft_jsonl": "paths",
}
COMMON_KEYS = frozenset({TYPE, "weight", "tags"})
# NeMo keys whose work the trainer does its own way (module docstring).
NO_EFFECT_KEYS = frozenset({"shuffle", "shard_seed", "max_open_streams", "force_finite"})
# NeMo's other types: plain text (language-model lines, no conversation) and the conversions
# of speech data into conversations, which its own prompt formats define.
LATER_TYPES = ("txt", "lhotse_as_conversation", "s2s_as_conversation")
NEMO_KIND = "nemo"  # the Source kind of NeMo manifests (train.data.source_cuts reads them)
NEMO_TARRED_KIND = "nemo_tarred"  # NeMo manifests with their audio in tar shards
# How NeMo pairs a manifest shard with a tar shard: the number in each file's name.
MANIFEST_SHARD = re.compile(r"manifest[^/]*_(\d+)[^/]*\.json")
TAR_SHARD = re.compile(r"audio[^/]*_(\d+)[^/]*\.tar")
TEXT_FIELD, LANG_FIELD = "text", "lang"


class NemoConfigError(ValueError):
    """A NeMo entry that cannot be used; the message names it and what is supported."""


def is_nemo_entry(entry: object) -> bool:
    return isinstance(entry, dict) and TYPE in entry


def translate(entries: list, where: str, cwd: Path) -> list[dict]:
    """NeMo ``input_cfg`` entries as the project's own entries (absolute paths, NeMo's weights,
    tags pushed down to the leaves so that a group's override its members')."""
    if not isinstance(entries, list) or not entries:
        raise NemoConfigError(f"{where}: expected a non-empty list of entries")
    weighted = [isinstance(e, dict) and "weight" in e for e in entries]
    if any(weighted) and not all(weighted):
        raise NemoConfigError(
            f"{where}: some entries have a weight and some do not; give every entry of the list "
            "a weight, or none (equal shares), as NeMo requires"
        )
    return [_entry(entry, f"{where}[{index}]", cwd) for index, entry in enumerate(entries)]


def _entry(entry: object, where: str, cwd: Path) -> dict:
    if not is_nemo_entry(entry):
        raise NemoConfigError(
            f"{where}: every entry of a NeMo input_cfg needs a type: ({', '.join(TYPE_KEYS)})"
        )
    assert isinstance(entry, dict)
    kind = entry[TYPE]
    if kind not in TYPE_KEYS:
        later = " (not yet: it comes with a later release)" if kind in LATER_TYPES else ""
        raise NemoConfigError(
            f"{where}: type {kind!r} is not supported{later}; supported: {', '.join(TYPE_KEYS)}"
        )
    allowed = TYPE_KEYS[kind] | COMMON_KEYS | NO_EFFECT_KEYS
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise NemoConfigError(
            f"{where}: type {kind} does not take {', '.join(unknown)}; it takes "
            f"{', '.join(sorted(TYPE_KEYS[kind] | COMMON_KEYS))} (and, with no effect here, "
            f"{', '.join(sorted(NO_EFFECT_KEYS))})"
        )
    tags = entry.get("tags") or {}
    if not isinstance(tags, Mapping):
        raise NemoConfigError(f"{where}: tags must be a mapping (key: value)")
    if kind == "group":
        translated = {"sources": _group_members(entry, where, cwd)}
    elif kind in CONVERSATION_TYPES or kind == "txt_pair":
        translated = _conversations(entry, where, cwd)
        if "system_prompt" in tags:  # NeMo's system text of a conversation source
            rest = {key: value for key, value in tags.items() if key != "system_prompt"}
            tags = {**rest, "system": tags["system_prompt"]}
    elif kind in ("nemo", NEMO_TARRED_KIND):
        translated = _nemo(entry, where, cwd)
    else:
        translated = _lhotse(entry, where, cwd)
    if "weight" in entry:
        translated["weight"] = entry["weight"]
    return _with_tags(translated, dict(tags))


def _with_tags(entry: dict, tags: dict) -> dict:
    """``entry`` with ``tags`` overriding its own and, in a group, every member's."""
    if not tags:
        return entry
    if "sources" in entry:
        entry["sources"] = [_with_tags(member, tags) for member in entry["sources"]]
    else:
        entry["tags"] = {**(entry.get("tags") or {}), **tags}
    return entry


def _group_members(entry: dict, where: str, cwd: Path) -> list[dict]:
    members = entry.get("input_cfg")
    if isinstance(members, str):
        path = _path(members, cwd)
        if not path.is_file():
            raise NemoConfigError(f"{where}: input_cfg {members}: no such file")
        members = yaml.safe_load(path.read_text())
    if members is None:
        raise NemoConfigError(f"{where}: a group needs its input_cfg (a list, or a YAML file)")
    return translate(members, f"{where}.input_cfg", cwd)


def _lhotse(entry: dict, where: str, cwd: Path) -> dict:
    shar = entry.get("shar_path")
    if shar is not None:
        if isinstance(shar, str):
            return {"shar": str(_location(shar, cwd, where)), "name": shar}
        if isinstance(shar, dict):  # {field: [shard, ...]}, e.g. URLs in object storage
            fields = {
                str(name): [str(_location(str(v), cwd, where)) for v in value]
                if isinstance(value, list)
                else value
                for name, value in shar.items()
            }
            first = next(iter(shar.get("cuts") or [""]), "")
            return {"shar": fields, "name": str(first) or "shar"}
        if isinstance(shar, list) and shar:
            members = []
            for given, weight in _weighted(shar, where, "shar_path"):
                directory = _location(given, cwd, where)
                if weight is None and isinstance(directory, str):
                    raise NemoConfigError(
                        f"{where}: shar_path {given} has no weight, and counting its cuts would "
                        "read every cut shard from object storage: give [path, weight] pairs"
                    )
                share = float(_shar_cuts(directory)) if weight is None else weight
                members.append({"shar": str(directory), "weight": share, "name": given})
            return {"sources": members}
        raise NemoConfigError(f"{where}: shar_path must be a directory or a list of them")
    cuts = entry.get("cuts_path")
    if not isinstance(cuts, str):
        raise NemoConfigError(
            f"{where}: type {entry[TYPE]} needs cuts_path (one file) or shar_path"
        )
    return {"cuts": str(_location(cuts, cwd, where)), "name": cuts}


def _nemo(entry: dict, where: str, cwd: Path) -> dict:
    fields = {
        "text_field": str(entry.get("text_field", TEXT_FIELD)),
        "lang_field": str(entry.get("lang_field", LANG_FIELD)),
    }
    given = entry.get("manifest_filepath")
    tars = next((entry[key] for key in TARRED_KEYS if key in entry), None)
    if tars is not None or entry[TYPE] == NEMO_TARRED_KIND:
        return _nemo_tarred(given, tars, fields, where, cwd)
    if isinstance(given, str):
        paths = [str(p) for p in _expanded(given, cwd, where)]
        return {NEMO_KIND: paths, "reader": fields, "name": given}
    if isinstance(given, list) and given:
        members = []
        for pattern, weight in _weighted(given, where, "manifest_filepath"):
            paths = _expanded(pattern, cwd, where)
            share = float(_lines(paths)) if weight is None else weight
            members.append(
                {
                    NEMO_KIND: [str(p) for p in paths],
                    "weight": share,
                    "reader": fields,
                    "name": pattern,
                }
            )
        return {"sources": members}
    raise NemoConfigError(f"{where}: type nemo needs manifest_filepath (a file or a list of them)")


def _conversations(entry: dict, where: str, cwd: Path) -> dict:
    """A conversation or text-pair entry as one ``conversations`` or ``text_pairs`` source; its
    files in NeMo's shard syntax (a string) or as a list."""
    kind = entry[TYPE]
    if kind == "txt_pair":
        sources = _files(entry.get("source_paths"), where, cwd, "source_paths")
        targets = _files(entry.get("target_paths"), where, cwd, "target_paths")
        if len(sources) != len(targets):
            raise NemoConfigError(
                f"{where}: {len(sources)} source_paths but {len(targets)} target_paths; each "
                "source file needs its target file"
            )
        translated: dict[str, Any] = {
            TEXT_PAIRS_KIND: [str(p) for p in sources + targets],
            "name": str(entry["source_paths"]),
        }
        if entry.get("questions_path"):
            questions = _existing(str(entry["questions_path"]), cwd, where)
            translated["reader"] = {"questions": str(questions)}
        return translated
    key = CONVERSATION_TYPES[kind]
    translated = {
        CONVERSATIONS_KIND: [str(p) for p in _files(entry.get(key), where, cwd, key)],
        "name": str(entry.get(key)),
    }
    if "audio_placeholders" in entry:
        marks = entry["audio_placeholders"]
        translated["reader"] = {"placeholders": [marks] if isinstance(marks, str) else list(marks)}
    return translated


def _files(given: Any, where: str, cwd: Path, key: str) -> list[Path]:
    """A key's files: NeMo's shard syntax in a string, or a list of such strings."""
    if isinstance(given, str):
        return _expanded(given, cwd, where)
    if isinstance(given, list) and given and all(isinstance(item, str) for item in given):
        return [path for item in given for path in _expanded(item, cwd, where)]
    raise NemoConfigError(f"{where}: {key} must be a file (NeMo's shard syntax) or a list of them")


def _weighted(items: list, where: str, key: str) -> list[tuple[str, float | None]]:
    """NeMo's list forms of ``key``: ``path``, ``[path]`` or ``[path, weight]``; a weight of
    None is NeMo's default, the path's size (lines, or cuts)."""
    found: list[tuple[str, float | None]] = []
    for item in items:
        if isinstance(item, str):
            found.append((item, None))
        elif isinstance(item, list | tuple) and len(item) in (1, 2):
            found.append((str(item[0]), float(item[1]) if len(item) == 2 else None))
        else:
            raise NemoConfigError(f"{where}: {key} list items are paths, [path] or [path, weight]")
    return found


def _nemo_tarred(given: Any, tars: Any, fields: dict, where: str, cwd: Path) -> dict:
    """A tarred NeMo dataset as one source: its paths are each manifest shard followed by its
    tar (NeMo's pairing by the shard number in the names), or, for one manifest whose lines say
    their ``shard_id``, that manifest followed by the tars in shard order."""
    if not isinstance(given, str) or not isinstance(tars, str):
        raise NemoConfigError(
            f"{where}: a tarred nemo entry takes manifest_filepath and tarred_audio_filepaths as "
            "strings (NeMo's shard syntax, e.g. audio__OP_0..7_CL_.tar); lists of them are not "
            "supported yet"
        )
    manifests, tar_paths = _expanded(given, cwd, where), _expanded(tars, cwd, where)
    by_shard = {}
    for tar in tar_paths:
        match = TAR_SHARD.search(tar.name)
        if match is None:
            raise NemoConfigError(f"{where}: {tar.name} is not named audio_<shard>.tar")
        by_shard[int(match.group(1))] = tar
    if len(manifests) == 1 and MANIFEST_SHARD.search(manifests[0].name) is None:
        shards = _manifest_shards(manifests[0])
        paths, layout = [manifests[0], *(by_shard[s] for s in sorted(by_shard))], "single"
    else:
        numbered = {}
        for manifest in manifests:
            match = MANIFEST_SHARD.search(manifest.name)
            if match is None:
                raise NemoConfigError(
                    f"{where}: {manifest.name} is not named manifest_<shard>.json"
                )
            numbered[int(match.group(1))] = manifest
        shards = set(numbered)
        paths = [p for shard in sorted(numbered) for p in (numbered[shard], by_shard.get(shard))]
        layout = "sharded"
    if shards != set(by_shard):
        raise NemoConfigError(
            f"{where}: the manifests name shards {sorted(shards)[:8]} but the tars "
            f"{sorted(by_shard)[:8]}; each manifest shard needs its tar"
        )
    return {
        NEMO_TARRED_KIND: [str(path) for path in paths],
        "reader": {**fields, "layout": layout},
        "name": given,
    }


def _manifest_shards(manifest: Path) -> set[int]:
    """The shard_id values of a single tarred manifest's lines."""
    shards = set()
    with open(manifest, encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                shard = json.loads(line).get("shard_id")
                if shard is None:
                    raise NemoConfigError(
                        f"{manifest}: a single tarred manifest needs shard_id on every line"
                    )
                shards.add(int(shard))
    return shards


def _expanded(pattern: str, cwd: Path, where: str) -> list[Path]:
    """NeMo's sharded-path syntax: ``_OP_``/``_CL_`` (and ``(``, ``[``, ``<`` and their closers)
    are braces, then bash-style brace expansion."""
    from braceexpand import braceexpand

    text = pattern
    for opener in ("_OP_", "(", "[", "<"):
        text = text.replace(opener, "{")
    for closer in ("_CL_", ")", "]", ">"):
        text = text.replace(closer, "}")
    return [_existing(path, cwd, where) for path in braceexpand(text, escape=False)]


def _path(path: str, cwd: Path) -> Path:
    resolved = Path(path).expanduser()
    return resolved if resolved.is_absolute() else cwd / resolved


def _location(path: str, cwd: Path, where: str) -> Path | str:
    """A lhotse entry's path: an object-storage URL as it is (``train.data.sources`` asks the store
    for it), else an existing local path."""
    return path if is_url(path) else _existing(path, cwd, where)


def _existing(path: str, cwd: Path, where: str) -> Path:
    if is_url(path):
        raise NemoConfigError(
            f"{where}: {path}: NeMo manifests, tars and input_cfg files are read from local "
            "paths; object storage (s3://) is read for lhotse and lhotse_shar entries"
        )
    resolved = _path(path, cwd)
    if not resolved.exists():
        raise NemoConfigError(f"{where}: {resolved} does not exist")
    return resolved


def _lines(paths: list[Path]) -> int:
    """Lines of JSON in the manifests (NeMo's weight for a manifest without one)."""
    total = 0
    for path in paths:
        opener: Any = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as lines:
            total += sum(1 for line in lines if line.strip())
    return total


def _shar_cuts(directory: Path) -> int:
    """Cuts in a Shar directory (NeMo's weight for a directory of a list without weights)."""
    return _lines(sorted(directory.glob("cuts.*.jsonl*")))


def validation_sets(mapping: Mapping, where: str, cwd: Path) -> list[dict]:
    """NeMo's ``validation_ds`` (its ``datasets:``) or the ``datasets`` mapping itself as
    the project's entries, one per set: ``{name: {input_cfg | shar_path | cuts_path |
    manifest_filepath, ...}}``. A set of one source is named by its key; one of several is
    several sets, ``<key>/<path>`` each. The rest of ``validation_ds`` (batch sizes, rates,
    prompt formats) is the dataloader's, which ``eval.*`` and the model config set here."""
    datasets = mapping.get("datasets", mapping)
    if not isinstance(datasets, Mapping) or not datasets:
        raise NemoConfigError(f"{where}: expected NeMo's datasets: {{name: config, ...}}")
    entries = []
    for name, conf in datasets.items():
        at = f"{where}: datasets.{name}"
        if not isinstance(conf, Mapping):
            raise NemoConfigError(f"{at}: expected a mapping (input_cfg:, shar_path:, ...)")
        if "input_cfg" in conf:
            members: Any = conf["input_cfg"]
            if isinstance(members, str):
                path = _existing(members, cwd, at)
                members = yaml.safe_load(path.read_text())
        elif "shar_path" in conf or "cuts_path" in conf:
            members = [
                {TYPE: "lhotse", **{k: conf[k] for k in ("shar_path", "cuts_path") if k in conf}}
            ]
        elif "manifest_filepath" in conf:
            keys = ("manifest_filepath", "text_field", "lang_field")
            members = [{TYPE: "nemo", **{k: conf[k] for k in keys if k in conf}}]
        else:
            raise NemoConfigError(
                f"{at}: give input_cfg, shar_path, cuts_path or manifest_filepath"
            )
        leaves = [leaf for entry in translate(members, at, cwd) for leaf in _leaves(entry)]
        for leaf in leaves:
            leaf["name"] = str(name) if len(leaves) == 1 else f"{name}/{leaf['name']}"
        entries += leaves
    return entries


def _leaves(entry: dict) -> list[dict]:
    if "sources" in entry:
        return [leaf for member in entry["sources"] for leaf in _leaves(member)]
    return [entry]
