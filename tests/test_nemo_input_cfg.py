"""NeMo's input_cfg read as it is (train/data/nemo_input_cfg.py, train/data/nemo_manifest.py): NeMo
manifests written here as NeMo documents them (JSON lines of audio_filepath, duration, text,
from LibriSpeech's own layout, never through the project's code), lhotse cut manifests and a
Shar directory written by lhotse, in groups with weights and tags; what NeMo refuses, or this
reader does not take yet, refused in one line; and a 2-rank training on such a config that
resumes exactly."""

from __future__ import annotations

import gzip
import json
import os
import tarfile
from pathlib import Path

import pytest
import soundfile
import yaml

from tests.harness.training import train
from train.data.features import AudioLimits
from train.data.nemo_manifest import NemoManifestCuts, nemo_cut
from train.data.source_cuts import check_sources, load_source_cuts
from train.data.sources import SourceError, read_sources, shares


def nemo_manifests(librispeech: Path, out: Path, shards: int = 2) -> list[Path]:
    """LibriSpeech's train-clean-100 as NeMo manifests (NeMo's documented format: one JSON line
    per utterance, audio_filepath relative to the manifest, duration in seconds, text), split
    into ``shards`` files named manifest_<i>.json."""
    lines = []
    for transcripts in sorted(
        (librispeech / "LibriSpeech" / "train-clean-100").rglob("*.trans.txt")
    ):
        for line in transcripts.read_text().splitlines():
            utterance, text = line.split(" ", 1)
            audio = transcripts.parent / f"{utterance}.flac"
            info = soundfile.info(str(audio))
            lines.append(
                {
                    "audio_filepath": os.path.relpath(audio, out),
                    "duration": info.frames / info.samplerate,
                    "text": text.lower(),
                    "speaker": utterance.split("-")[0],
                }
            )
    assert len(lines) >= shards
    paths = []
    for shard in range(shards):
        path = out / f"manifest_{shard}.json"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines[shard::shards]))
        paths.append(path)
    return paths


def nemo_tarred(manifest: Path, out: Path, shards: int = 2) -> list[dict]:
    """A tarred dataset in the layout of NeMo's scripts/speech_recognition/
    convert_to_tarred_audio_dataset.py: the audio of ``manifest``'s lines in ``audio_<i>.tar``
    (each member named by its path with ``/`` and ``.`` made ``_`` before the extension), their
    lines (audio_filepath the member's name, and shard_id) in
    ``sharded_manifests/manifest_<i>.json``, and all of them in ``tarred_audio_manifest.json``.
    Shard 0 lists its first file twice, as a converter given a repeated file writes it: the
    audio once, the second line named ``-sub1``. Returns every line written."""
    lines = [json.loads(line) for line in manifest.read_text().splitlines()]
    groups = [lines[shard::shards] for shard in range(shards)]
    groups[0].append(dict(groups[0][0]))
    (out / "sharded_manifests").mkdir(parents=True)
    every = []
    for shard, group in enumerate(groups):
        kept, written = [], {}
        with tarfile.open(out / f"audio_{shard}.tar", "w") as tar:
            for line in group:
                audio = (manifest.parent / line["audio_filepath"]).resolve()
                stem = "_".join(audio.with_suffix("").parts[-2:]).replace(".", "_")
                name = f"{stem}{audio.suffix}"
                if name in written:
                    written[name] += 1
                    member = f"{stem}-sub{written[name] - 1}{audio.suffix}"
                else:
                    tar.add(audio, arcname=name)
                    written[name], member = 1, name
                kept.append({**line, "audio_filepath": member, "shard_id": shard})
        text = "".join(json.dumps(line) + "\n" for line in kept)
        (out / "sharded_manifests" / f"manifest_{shard}.json").write_text(text)
        every += kept
    text = "".join(json.dumps(line) + "\n" for line in every)
    (out / "tarred_audio_manifest.json").write_text(text)
    return every


def write_yaml(path: Path, entries: list) -> Path:
    path.write_text(yaml.safe_dump(entries))
    return path


def test_groups_weights_and_tags_as_nemo_reads_them(tmp_path, monkeypatch) -> None:
    """Weights multiply down the groups, a group's tags override its members', relative paths
    resolve against the current directory, NeMo's shard syntax expands, a manifest list without
    weights is weighted by lines, and a Shar list by cuts."""
    monkeypatch.chdir(tmp_path)
    for shard in range(3):
        (tmp_path / f"m_{shard}.json").write_text('{"audio_filepath": "a.wav", "duration": 1}\n')
    (tmp_path / "big.json").write_text('{"audio_filepath": "a.wav", "duration": 1}\n' * 3)
    (tmp_path / "cuts.jsonl.gz").touch()
    entries = [
        {
            "type": "group",
            "weight": 3,
            "tags": {"lang": "en", "kind": "outer"},
            "input_cfg": [
                {"type": "nemo", "manifest_filepath": "m__OP_0..2_CL_.json", "weight": 1},
                {
                    "type": "lhotse",
                    "cuts_path": "cuts.jsonl.gz",
                    "weight": 3,
                    "tags": {"kind": "inner", "x": 1},
                },
            ],
        },
        {"type": "nemo", "manifest_filepath": ["m_0.json", "big.json"], "weight": 1},
    ]
    sources = {
        s.name: s for s in read_sources(write_yaml(tmp_path / "in.yaml", entries), "data.input_cfg")
    }
    assert sorted(sources) == ["big.json", "cuts.jsonl.gz", "m_0.json", "m__OP_0..2_CL_.json"]
    sharded = sources["m__OP_0..2_CL_.json"]
    assert sharded.kind == "nemo" and [p.name for p in sharded.paths] == [
        "m_0.json",
        "m_1.json",
        "m_2.json",
    ]
    assert sources["cuts.jsonl.gz"].tags == {"kind": "outer", "x": 1, "lang": "en"}
    share = shares(sources.values())
    assert share["m__OP_0..2_CL_.json"] == pytest.approx(0.75 * 0.25)
    assert share["cuts.jsonl.gz"] == pytest.approx(0.75 * 0.75)
    assert share["m_0.json"] == pytest.approx(0.25 * 1 / 4)  # NeMo's weight: lines
    assert share["big.json"] == pytest.approx(0.25 * 3 / 4)
    for name, cuts in (("one", 1), ("three", 3)):
        (tmp_path / name).mkdir()
        with gzip.open(tmp_path / name / "cuts.000000.jsonl.gz", "wt") as lines:
            lines.write('{"id": "c"}\n' * cuts)
    shar = [{"type": "lhotse_shar", "shar_path": ["one", "three"]}]
    assert shares(read_sources(shar, "data.input_cfg")) == {"one": 0.25, "three": 0.75}
    weighted = [{"type": "lhotse", "shar_path": [["one", 3], ["three", 1]]}]
    assert shares(read_sources(weighted, "data.input_cfg")) == {"one": 0.75, "three": 0.25}


@pytest.mark.parametrize(
    "entries, says",
    [
        ([{"type": "txt", "paths": "a.txt"}], "type 'txt' is not supported (not yet"),
        ([{"type": "webdataset"}], "type 'webdataset' is not supported; supported: lhotse"),
        (
            [{"type": "nemo", "manifest_filepath": "m.json", "metadata_only": True}],
            "does not take metadata_only",
        ),
        (
            [
                {"type": "nemo", "manifest_filepath": "m.json", "weight": 1},
                {"type": "nemo", "manifest_filepath": "m.json"},
            ],
            "some entries have a weight",
        ),
        ([{"type": "nemo", "manifest_filepath": "missing.json"}], "missing.json does not exist"),
        ([{"type": "lhotse"}], "needs cuts_path"),
        ([{"type": "group", "input_cfg": "nowhere.yaml"}], "nowhere.yaml: no such file"),
    ],
)
def test_what_is_not_supported_is_one_line(tmp_path, monkeypatch, entries, says) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.json").write_text('{"audio_filepath": "a.wav", "duration": 1}\n')
    with pytest.raises(SourceError) as error:
        read_sources(entries, "data.input_cfg")
    assert says in str(error.value) and "\n" not in str(error.value)


def test_a_manifest_line_becomes_the_cut_nemo_makes(tmp_path, librispeech) -> None:
    """A relative path beside the manifest, an offset (NeMo's id), the other keys kept, the
    language field named by the entry; a missing audio file is set aside by the source check
    with its reason, and the rest of the source trains."""
    (manifest,) = nemo_manifests(librispeech, tmp_path, shards=1)
    first = json.loads(manifest.read_text().splitlines()[0])
    cut = nemo_cut(
        {**first, "offset": 0.5, "duration": 1.0, "language": "en"}, manifest, lang_field="language"
    )
    stem = Path(first["audio_filepath"]).stem
    assert cut.id == f"{stem}-000050-000100" and cut.start == 0.5 and cut.duration == 1.0
    assert cut.supervisions[0].language == "en" and cut.custom["speaker"] == first["speaker"]
    assert cut.load_audio().shape[1] == 16000
    lines = manifest.read_text().splitlines()
    broken = json.loads(lines[1]) | {"audio_filepath": "gone.flac"}
    manifest.write_text("\n".join([lines[0], json.dumps(broken), *lines[2:], ""]))
    (source,) = read_sources(
        [{"type": "nemo", "manifest_filepath": str(manifest)}], "data.input_cfg"
    )
    said: list[str] = []
    (check,) = check_sources(
        [source], None, AudioLimits(min_rate=16000, max_seconds=None), said.append
    )
    assert check.usable == len(lines) - 1 and check.reasons == {"audio file missing": 1}
    assert len(list(load_source_cuts(source))) == len(lines)
    assert len(list(NemoManifestCuts((manifest,)))) == len(lines)


@pytest.mark.slow
def test_a_nemo_input_cfg_trains_on_two_ranks_and_resumes_exactly(
    tmp_path, corpus, tiny_corpus, librispeech
) -> None:
    """NeMo manifests (2 shards, one source), a lhotse cut manifest in a weighted group, a lhotse
    Shar directory and a tarred NeMo dataset, as a NeMo user's input_cfg file has them: 4 steps
    straight, and 2 + 2 steps across two jobs with the same seed, read the very same batches
    (their hashes), every source drawn from."""
    (tmp_path / "nemo").mkdir()
    nemo_manifests(librispeech, tmp_path / "nemo")
    nemo_tarred(tmp_path / "nemo" / "manifest_0.json", tmp_path / "tarred")
    input_cfg = write_yaml(
        tmp_path / "input_cfg.yaml",
        [
            {
                "type": "group",
                "weight": 0.5,
                "tags": {"domain": "speech"},
                "input_cfg": [
                    {
                        "type": "nemo",
                        "manifest_filepath": str(tmp_path / "nemo" / "manifest__OP_0..1_CL_.json"),
                        "weight": 1,
                    },
                    {
                        "type": "lhotse",
                        "cuts_path": str(corpus / "cuts_train.jsonl.gz"),
                        "weight": 1,
                    },
                ],
            },
            {
                "type": "lhotse_shar",
                "shar_path": str(tiny_corpus / "shar" / "train"),
                "weight": 0.25,
                "shuffle": True,
            },
            {
                "type": "nemo",
                "manifest_filepath": str(tmp_path / "tarred" / "tarred_audio_manifest.json"),
                "tarred_audio_filepaths": str(tmp_path / "tarred" / "audio__OP_0..1_CL_.tar"),
                "weight": 0.25,
            },
        ],
    )
    common = (
        f"data.input_cfg={input_cfg}",
        "seed=5",
        "debug.batch_hashes=true",
        "train.max_steps=4",
        "data.num_workers=0",
    )
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(straight, corpus, *common, nproc=2)
    train(split, corpus, *common, "train.max_steps_per_run=2", nproc=2)
    resumed = train(split, corpus, *common, nproc=2)
    assert "resumed from" in resumed.stderr

    def hashes(run_dir: Path) -> list[tuple[int, str]]:
        rows = [
            json.loads(line)
            for line in (run_dir / "batch_hashes" / "rank0.jsonl").read_text().splitlines()
        ]
        return [(row["step"], row["hash"]) for row in rows]

    assert [step for step, _ in hashes(straight)] == [1, 2, 3, 4]
    assert hashes(split) == hashes(straight)
    rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    drawn = {key for row in rows for key, value in row.items() if key.startswith("cuts/") and value}
    assert len(drawn) == 4, drawn


def test_nemos_validation_datasets_are_eval_sets(tmp_path, monkeypatch) -> None:
    """validation_ds as a NeMo config has it: each of its datasets is a set named by its key
    (one of several sources: a set per source, under the key); its dataloader options are
    the eval config's business here."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dev.json").write_text('{"audio_filepath": "a.wav", "duration": 1}\n')
    (tmp_path / "cuts.jsonl.gz").touch()
    validation_ds = {
        "batch_size": 4,
        "datasets": {
            "dev_clean": {"manifest_filepath": "dev.json"},
            "mixed": {
                "input_cfg": [
                    {"type": "lhotse", "cuts_path": "cuts.jsonl.gz"},
                    {"type": "nemo", "manifest_filepath": "dev.json"},
                ]
            },
        },
    }
    path = write_yaml(tmp_path / "validation.yaml", validation_ds)
    for spec in (path, validation_ds, validation_ds["datasets"]):
        sets = read_sources(spec, "eval.sets")
        names = [source.name for source in sets]
        assert names == ["dev_clean", "mixed/cuts.jsonl.gz", "mixed/dev.json"], names
    with pytest.raises(SourceError, match=r"datasets\.bad: give input_cfg"):
        read_sources({"datasets": {"bad": {"batch_size": 2}}}, "eval.sets")


@pytest.mark.parametrize("layout", ["sharded", "single"])
def test_a_tarred_nemo_dataset_reads_as_nemo_reads_it(tmp_path, librispeech, layout) -> None:
    """NeMo's converter layout: sharded manifests paired with their tars by number (or the one
    manifest with shard_id), every line a cut of its member's audio, the repeated file's -sub1
    line too; the source check reads the manifests only, with the same ids; a tar whose member
    no line names stops the reading, naming both."""
    (manifest,) = nemo_manifests(librispeech, tmp_path, shards=1)
    out = tmp_path / "tarred"
    written = nemo_tarred(manifest, out)
    manifests = {
        "sharded": str(out / "sharded_manifests" / "manifest__OP_0..1_CL_.json"),
        "single": str(out / "tarred_audio_manifest.json"),
    }[layout]
    entry = {
        "type": "nemo_tarred",
        "manifest_filepath": manifests,
        "tarred_audio_filepath": str(out / "audio__OP_0..1_CL_.tar"),
    }
    (source,) = read_sources([entry], "data.input_cfg")
    cuts = list(load_source_cuts(source))
    assert sorted(cut.id for cut in cuts) == sorted(line["audio_filepath"] for line in written)
    assert all(cut.load_audio().shape[1] == round(cut.duration * 16000) for cut in cuts)
    repeated = [cut for cut in cuts if "-sub1" in cut.id]
    assert len(repeated) == 1 and repeated[0].recording.id == repeated[0].id.replace("-sub1", "")
    said: list[str] = []
    (check,) = check_sources([source], None, AudioLimits(min_rate=16000), said.append)
    assert check.usable == len(written) and not said
    with tarfile.open(out / "audio_1.tar", "a") as tar:
        tar.add(manifest, arcname="stranger.wav")
    with pytest.raises(ValueError, match=r"member stranger\.wav has no line in"):
        list(load_source_cuts(source))
    broken = {**entry, "tarred_audio_filepath": str(out / "audio__OP_0..0_CL_.tar")}
    with pytest.raises(SourceError, match="each manifest shard needs its tar"):
        read_sources([broken], "data.input_cfg")
