"""The speech chat (recipes/conf/salm_speech_chat.yaml): the real speech LLM, Whisper tiny.en's
frozen encoder and SmolLM2-135M-Instruct with LoRA, on ASR, spoken questions and capitals. Its
GPU run (bench/gpu_speech_chat.sh) in the reduced CPU form, so that the recipe, the pack's data
and every part of the run keep working where no GPU is lent; and the carried parts' checks."""

from __future__ import annotations

import json
import os
import tarfile

import pytest

from bench.speech_chat_pack import SPLITS, SUMS, make_data, split_tar
from contract.run_dir import CUTS_PREFIX
from recipes.pretrained import SMOLLM2, WHISPER
from tests.harness.models import pretrained_model
from tests.harness.process import REPO, run_bash
from train.data.loader import load_cuts

SCRIPT = REPO / "bench/gpu_speech_chat.sh"


# Whisper's anchor, the base LLM's capitals, three trainings of 2 steps side by side and their
# evaluations: 1.4 min alone on this 2-core machine.
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_speech_chat_runs_every_part_on_the_cpu(corpus, tmp_path):
    pretrained = pretrained_model(WHISPER.name).parent
    pretrained_model(SMOLLM2.name)
    data = tmp_path / "data"
    make_data(corpus, data, limit=6)
    # The pack's audio is Ogg Opus, every cut's, at the corpus's length.
    cuts = [cut for split in SPLITS for cut in load_cuts(data / f"corpus/cuts_{split}.jsonl.gz")]
    assert {p.suffix for p in (data / "corpus/audio").iterdir()} == {".ogg"}
    assert all(cut.load_audio().shape[1] == cut.num_samples for cut in cuts)
    out = tmp_path / "out"
    out.mkdir()
    args = ["--cpu", "--data", str(data), "--out", str(out), "--pretrained", str(pretrained)]
    done = run_bash(SCRIPT, *args)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    record = json.loads((out / "gpu_speech_chat.json").read_text())
    results = record["results"]
    assert set(results) == {"base", "chat", "no_text", "baseline"}
    # The base model answers the held-out capitals in the task's sentence, mostly.
    base = results["base"]
    assert base["answers"] == 24 and base["right"] > 0.5
    assert base["replies"][0]["reply"].strip() == "The capital of Germany is Berlin."
    for part in ("chat", "no_text"):
        assert results[part]["steps"] == 2, part
    # The baseline is evaluated at its first checkpoint to have drawn the chat's ASR cuts.
    baseline, chat_cuts = results["baseline"], results["chat"]["asr_cuts"]
    assert baseline["steps"] in (1, 2) and baseline["asr_cuts"] > 0
    assert baseline["asr_cuts"] >= chat_cuts or baseline["steps"] == 2
    assert set(results["chat"]["test"]) == {"asr", "spoken", "capitals"}
    assert set(results["no_text"]["test"]) == {"asr", "spoken", "capitals"}
    assert set(results["baseline"]["test"]) == {"asr"}
    # The recipe's mixture reads the capitals as a source of its own; the run without text not.
    sources = {
        part: {
            key
            for row in map(json.loads, (out / "speech_chat_runs" / part / "metrics.jsonl").open())
            for key in row
            if key.startswith(CUTS_PREFIX)
        }
        for part in ("chat", "no_text")
    }
    assert sources["chat"] == {f"{CUTS_PREFIX}{name}" for name in ("asr", "spoken", "capitals")}
    assert sources["no_text"] == {f"{CUTS_PREFIX}{name}" for name in ("asr", "spoken")}
    table = done.stdout.splitlines()
    assert table[0].startswith("| model |") and len([x for x in table if x.startswith("| ")]) == 6
    assert any(line.startswith("- capitals kept without text") for line in table)


def test_the_carried_parts_are_checked_before_anything_is_unpacked(tmp_path):
    pack = tmp_path / "speech_chat"
    (pack / "data").mkdir(parents=True)
    (pack / "data/blob").write_bytes(os.urandom(5 * 2**19))  # 2.5 MiB that do not compress
    (pack / "anchor.json").write_text("{}")
    parts_dir = tmp_path / "parts"
    parts = split_tar(pack, parts_dir, part_mib=1)
    assert [p.name for p in parts] == ["part-00", "part-01", "part-02"]
    assert all(p.stat().st_size <= 2**20 for p in parts)
    # The parts make up the pack again.
    joined = tmp_path / "joined.tar"
    joined.write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(joined) as archive:
        archive.extractall(tmp_path / "again", filter="data")
    assert (tmp_path / "again/speech_chat/data/blob").read_bytes() == (
        pack / "data/blob"
    ).read_bytes()
    assert len((parts_dir / SUMS).read_text().splitlines()) == 3

    work = tmp_path / "work"
    env = {"SPEECH_CHAT_PARTS": str(parts_dir), "SPEECH_CHAT_WORK": str(work)}
    (parts_dir / "part-01").rename(tmp_path / "part-01")
    done = run_bash(SCRIPT, env=env, timeout=60)
    assert done.returncode == 2 and "part-01 is missing: carry each part" in done.stderr
    assert not work.exists()
    corrupted = bytearray((tmp_path / "part-01").read_bytes())
    corrupted[1000] ^= 1
    (parts_dir / "part-01").write_bytes(corrupted)
    done = run_bash(SCRIPT, env=env, timeout=60)
    assert done.returncode == 2 and "is not the one packed (sha256)" in done.stderr
    assert not work.exists()
    done = run_bash(SCRIPT, env={**env, "SPEECH_CHAT_PARTS": str(tmp_path / "none")}, timeout=60)
    assert done.returncode == 2 and "run python -m bench.speech_chat_pack" in done.stderr
