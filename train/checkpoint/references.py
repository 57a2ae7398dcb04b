"""Frozen pretrained parts in a checkpoint, held by reference: which directory each was loaded
from and the digests of its weight files, not its tensors.

A LoRA run on a pretrained LLM with a frozen pretrained encoder trains a few MB; the frozen base
is the rest of a checkpoint's bytes and never changes. So a checkpoint's ``state.json`` records,
for each pretrained part whose parameters it leaves out (``train.models.pretrained_parts``)::

    "references": {"pretrained_llm": {"directory": "/abs/smollm2-135m",
                                      "files": {"model.safetensors":
                                                {"size": ..., "mtime_ns": ..., "sha256": ...}}}}

and a resume loads those parameters from that part's files, which must still be the ones
recorded. A file is hashed once: while it keeps its directory, size and modification time, its
recorded digest stands (as rsync and make judge a file), so a job's start costs a few stats,
not a read of the whole base. Torch-free: the trainer's preflight reads it before any process
group.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from train.checkpoint.location import checkpoint_name, newest_state
from train.models.hf_config import WEIGHT_FILES
from train.models.pretrained_parts import PARTS

REFERENCES = "references"  # state.json's key


class PretrainedPartChanged(ValueError):
    """A part a checkpoint holds by reference is no longer in its files: one line naming the
    file. Not a broken checkpoint (it is not set aside): the files must be put back."""


def weight_files(directory: Path) -> list[str]:
    """The names of the weight files in ``directory``: one safetensors file, or an index and
    the shards it lists."""
    single, index = (directory / name for name in WEIGHT_FILES)
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [index.name, *shards]
    return [single.name]


def _sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _unchanged(path: Path, stat: os.stat_result, known: dict | None) -> bool:
    return known is not None and (known["size"], known["mtime_ns"]) == (
        stat.st_size,
        stat.st_mtime_ns,
    )


def identity(directory: Path, known: dict | None = None) -> dict:
    """The record of the part in ``directory``: the directory and each weight file's size,
    modification time and sha256. ``known``: an earlier record of the same directory, whose
    digest of a file with the same size and modification time is kept (not reread)."""
    directory = Path(directory)
    same_place = known is not None and known["directory"] == str(directory)
    files = {}
    for name in weight_files(directory):
        path = directory / name
        stat = path.stat()
        before = known["files"].get(name) if same_place and known else None
        digest = before["sha256"] if _unchanged(path, stat, before) else _sha256(path)
        files[name] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest}
    return {"directory": str(directory), "files": files}


def mismatch(record: dict, directory: Path) -> str | None:
    """Why ``directory`` does not hold the part ``record`` identifies, naming the first file
    that differs; None when it does. Where ``directory`` is the recorded one and a file's size
    and modification time are as recorded, the file is not reread."""
    directory = Path(directory)
    same_place = record["directory"] == str(directory)
    for name, recorded in record["files"].items():
        path = directory / name
        try:
            stat = path.stat()
        except OSError:
            return f"{path} is missing"
        if same_place and _unchanged(path, stat, recorded):
            continue
        digest = _sha256(path)
        if digest != recorded["sha256"]:
            return (
                f"{path} is not the file it was (sha256 {recorded['sha256'][:12]}... then, "
                f"{digest[:12]}... now)"
            )
    return None


def part_directory(key: str, record: dict, configured: dict[str, str | None]) -> Path:
    """Where a resume loads part ``key`` from: the config's directory for it, else the one the
    checkpoint recorded."""
    return Path(configured.get(key) or record["directory"])


def refusal(checkpoint: Path | str, key: str, record: dict, problem: str) -> str:
    return (
        f"checkpoint {checkpoint_name(checkpoint)} holds the frozen {PARTS[key]} by reference to "
        f"{record['directory']}, and {problem}: put the part's files back as they were (or "
        "point the config at a copy of them), or start a new run_dir"
    )


def check_newest(run_dir: Path, configured: dict[str, str | None]) -> None:
    """Raise PretrainedPartChanged if the run dir's newest complete checkpoint holds a part by
    reference whose files (where the config says, else where it recorded) are not the
    recorded ones. A checkpoint whose state cannot be read is the load's to judge."""
    newest = newest_state(run_dir)
    if newest is None:
        return
    checkpoint, state = newest
    references = state.get(REFERENCES) or {}
    for key, record in references.items():
        problem = mismatch(record, part_directory(key, record, configured))
        if problem is not None:
            raise PretrainedPartChanged(refusal(checkpoint, key, record, problem))
