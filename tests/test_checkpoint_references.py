"""Frozen pretrained parts held by reference (``checkpoint.by_reference``): a checkpoint of a
LoRA run on a pretrained LLM with a frozen pretrained encoder holds what trains and the parts'
identities, and every way a user comes back to it works or is refused in one line.

The digests (``train.checkpoint.references``) on real files; then real training of tiny
Hugging Face models (tests/harness/hf_tiny.py) as their own tools write them: the checkpoint's
keys and bytes against the planner's figure, a changed frozen file refused before any process
group, a part frozen when saved that trains in the next job. The bitwise resumes with the real
models of ``make pretrained`` are tests/test_pretrained_salm.py's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from contract.run_dir import STATE_FILE, complete_checkpoints
from tests.harness.hf_tiny import save_tiny, save_tiny_encoder
from tests.harness.models import final_model
from tests.harness.process import run_tool
from tests.harness.training import train
from train.checkpoint.references import (
    REFERENCES,
    PretrainedPartChanged,
    check_newest,
    identity,
    mismatch,
)

LORA = ("model.lora.rank=4", "model.lora.alpha=8")
FROZEN_ENCODER = r"model.freeze=['^encoder\.']"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def flip_last_byte(path: Path) -> None:
    """A user's change to a file in place: same size, other content, a new mtime."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


# the digests --------------------------------------------------------------------------------


def test_a_part_is_its_files_wherever_they_are_and_a_changed_byte_is_named(tmp_path) -> None:
    part = tmp_path / "part"
    part.mkdir()
    (part / "model.safetensors").write_bytes(os.urandom(4096))
    record = identity(part)
    assert record["files"]["model.safetensors"]["sha256"] == sha256(part / "model.safetensors")
    assert mismatch(record, part) is None
    (part / "model.safetensors").touch()  # a new mtime, the same bytes: read again, accepted
    assert mismatch(record, part) is None
    copy = shutil.copytree(part, tmp_path / "copy")
    assert mismatch(record, copy) is None
    flip_last_byte(copy / "model.safetensors")
    found = mismatch(record, copy)
    assert found is not None and str(copy / "model.safetensors") in found
    assert "is not the file it was" in found
    (part / "model.safetensors").unlink()
    assert mismatch(record, part) == f"{part / 'model.safetensors'} is missing"


def test_a_file_keeps_its_digest_while_its_size_and_mtime_stand(tmp_path) -> None:
    """The stat rule that spares a job start reading the whole base: a file rewritten and
    given its old mtime back keeps its recorded digest (as rsync judges it)."""
    part = tmp_path / "part"
    part.mkdir()
    weights = part / "model.safetensors"
    weights.write_bytes(b"a" * 1000)
    first = identity(part)
    stat = weights.stat()
    weights.write_bytes(b"b" * 1000)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert identity(part, first) == first
    assert identity(part)["files"]["model.safetensors"]["sha256"] == sha256(weights)


def test_a_sharded_part_is_its_index_and_every_shard(tmp_path) -> None:
    part = tmp_path / "part"
    part.mkdir()
    shards = {
        "a.weight": "model-00001-of-00002.safetensors",
        "b.weight": "model-00002-of-00002.safetensors",
    }
    (part / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shards}))
    for name in shards.values():
        (part / name).write_bytes(name.encode())
    record = identity(part)
    assert sorted(record["files"]) == sorted(["model.safetensors.index.json", *shards.values()])
    flip_last_byte(part / shards["b.weight"])
    assert shards["b.weight"] in (mismatch(record, part) or "")


def test_the_start_check_reads_the_newest_complete_checkpoint(tmp_path) -> None:
    part = tmp_path / "part"
    part.mkdir()
    (part / "model.safetensors").write_bytes(b"x" * 100)
    checkpoints = tmp_path / "checkpoints"
    record = identity(part)
    for step, references in ((1, {}), (2, {"pretrained_llm": record})):
        (checkpoints / f"step_{step}").mkdir(parents=True)
        state = {"step": step, "trainer_state": {}, REFERENCES: references}
        (checkpoints / f"step_{step}" / STATE_FILE).write_text(json.dumps(state))
        (checkpoints / f"step_{step}" / "COMPLETE").write_text("")
    check_newest(tmp_path, {"pretrained_llm": str(part)})
    flip_last_byte(part / "model.safetensors")
    with pytest.raises(PretrainedPartChanged, match="step_2 holds the frozen LLM") as error:
        check_newest(tmp_path, {"pretrained_llm": None})  # the recorded directory
    assert "\n" not in str(error.value) and "start a new run_dir" in str(error.value)


# real training of tiny pretrained parts ----------------------------------------------------


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("parts")
    return {
        "llm": save_tiny("llama", root / "llama"),
        "encoder": save_tiny_encoder("whisper", root / "whisper"),
    }


def pretrained(parts: dict[str, Path]) -> tuple[str, ...]:
    return (f"model.pretrained_llm={parts['llm']}", f"model.pretrained_encoder={parts['encoder']}")


def tensor_bytes(checkpoint: Path) -> dict[str, int]:
    """Each tensor's bytes in a checkpoint, by key, from DCP's metadata."""
    metadata = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    return {
        key: item.size.numel() * item.properties.dtype.itemsize
        for key, item in metadata.items()
        if hasattr(item, "size") and len(item.size)
    }


def test_a_lora_checkpoint_holds_what_trains_and_its_parts_identities(
    parts, corpus, tmp_path
) -> None:
    """LoRA on the LLM, the encoder frozen, 2 ranks of FSDP2: the checkpoint holds the
    adapters, the projector and their Adam moments, and for each part its directory and the
    sha256 of its file: a whole checkpoint (``checkpoint.by_reference=false``) less the two
    parts' weights."""
    settings = (*pretrained(parts), *LORA, FROZEN_ENCODER, "train.max_steps=1")
    train(tmp_path / "run", corpus, *settings, nproc=2)
    train(tmp_path / "whole", corpus, *settings, "checkpoint.by_reference=false", nproc=2)
    [checkpoint] = complete_checkpoints(tmp_path / "run").values()
    [whole] = complete_checkpoints(tmp_path / "whole").values()
    saved, everything = tensor_bytes(checkpoint), tensor_bytes(whole)
    models = {key for key in saved if key.startswith("model.")}
    assert models and all(".lora_" in k or k.startswith("model.projector.") for k in models)
    assert {"model.llm.embed.weight", "model.encoder.conv1.weight"} <= set(everything)
    references = json.loads((checkpoint / STATE_FILE).read_text())[REFERENCES]
    for part, key in (("llm", "pretrained_llm"), ("encoder", "pretrained_encoder")):
        assert references[key]["directory"] == str(parts[part])
        files = references[key]["files"]
        assert files["model.safetensors"]["sha256"] == sha256(parts[part] / "model.safetensors")
    assert (
        REFERENCES not in json.loads((whole / STATE_FILE).read_text())
        or not json.loads((whole / STATE_FILE).read_text())[REFERENCES]
    )
    left_out = {
        key
        for key in everything
        if key.startswith(("model.llm.", "model.encoder.")) and ".lora_" not in key
    }
    assert set(everything) - set(saved) == left_out
    assert {key: everything[key] for key in saved} == saved


def test_the_plan_says_what_a_checkpoint_of_the_run_holds(parts, corpus, tmp_path) -> None:
    """``orchestrator plan --hf-config DIR --lora-rank R``: its checkpoint figure is the tensor
    bytes the run's checkpoint holds (the LLM by reference, the preset's encoder trained)."""
    train(
        tmp_path / "run", corpus, f"model.pretrained_llm={parts['llm']}", *LORA, "train.max_steps=1"
    )
    [checkpoint] = complete_checkpoints(tmp_path / "run").values()
    plan = run_tool(
        "orchestrator",
        *("plan", "--model", "tiny", "--hf-config", str(parts["llm"]), "--lora-rank", "4"),
        *("--gpus", "1", "--json"),
    )
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["checkpoint_bytes"] == sum(tensor_bytes(checkpoint).values())


def test_a_changed_frozen_file_is_refused_before_any_process_group(parts, corpus, tmp_path) -> None:
    """A copy of the LLM trains a job; one byte of its file changes; the next job of the chain
    (2 ranks) stops with one line naming the file and exit 2, before any process group, and
    leaves the checkpoint as it was."""
    llm = shutil.copytree(parts["llm"], tmp_path / "llama")
    settings = (f"model.pretrained_llm={llm}", *LORA, "train.max_steps=2")
    train(tmp_path / "run", corpus, *settings, "train.max_steps_per_run=1", nproc=2)
    flip_last_byte(llm / "model.safetensors")
    refused = train(tmp_path / "run", corpus, *settings, nproc=2, check=False)
    assert refused.returncode == 2, refused.stderr[-2000:]
    [line] = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert f"{llm / 'model.safetensors'} is not the file it was" in line
    assert "checkpoint step_1 holds the frozen LLM by reference" in line
    assert "process group" not in refused.stdout + refused.stderr
    assert sorted(complete_checkpoints(tmp_path / "run")) == [1]


def test_a_part_frozen_when_saved_trains_in_the_next_job_from_its_files(
    parts, corpus, tmp_path
) -> None:
    """Job 1 keeps the encoder frozen (by reference); job 2 unfreezes it: the encoder loads
    from its files, its Adam moments start at zero, it trains, and the next checkpoint holds
    it, but for Whisper's positions, which never train (they and the LLM, still frozen under
    LoRA, stay by reference)."""
    run_dir = tmp_path / "run"
    first = (*pretrained(parts), *LORA, "train.max_steps=2")
    train(run_dir, corpus, *first, FROZEN_ENCODER, "train.max_steps_per_run=1")
    second = train(run_dir, corpus, *first)
    log = second.stdout + second.stderr
    assert "encoder held by reference: loaded from" in log
    assert "optimizer state starts fresh" in log
    checkpoint = complete_checkpoints(run_dir)[2]
    held = tensor_bytes(checkpoint)
    assert "model.encoder.conv1.weight" in held
    assert "model.encoder.embed_positions.weight" not in held
    references = json.loads((checkpoint / STATE_FILE).read_text())[REFERENCES]
    assert sorted(references) == ["pretrained_encoder", "pretrained_llm"]
    weights = final_model(run_dir)
    files = load_file(parts["encoder"] / "model.safetensors")
    stored = next(v for k, v in files.items() if k.endswith("encoder.conv1.weight"))
    assert not torch.equal(weights["encoder.conv1.weight"], stored), "the encoder did not train"
