"""Sources in object storage, as users keep them: a lhotse Shar written by lhotse's own
``to_shar`` and a cut manifest whose audio sits beside it, in a real S3-compatible store
(``rclone serve s3`` on loopback), read as streams with the credentials in the environment only.

The runs: 2 ranks train on the Shar and validate on the manifest, as one job of 6 steps and as
two jobs of 3; the second resumes bit for bit (losses and validation losses), the secret key is
in no file they write, and the audio came from the bucket. The start-of-job check asks the
store for metadata and cut shards only, never an audio object. A missing bucket or prefix, a
wrong secret, an unreachable endpoint and a scheme the toolkit does not read are each one line
before anything starts."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from lhotse import CutSet

from tests.harness.object_store import SECRET_KEY, ObjectStore, free_port, object_store
from tests.harness.training import metrics, train, train_overrides, train_together
from train.data.source_cuts import load_source_cuts
from train.data.sources import SourceError, read_sources
from train.data.storage import shar_shards

BUCKET = "speech"
SHAR = f"s3://{BUCKET}/shar/train"
DEV = f"s3://{BUCKET}/cuts/dev.jsonl.gz"
# Enough cuts for 6 steps of 2 ranks and the sampler's buffers (the whole corpus's 469 made the
# bucketing buffer stream ~5,500 objects before the first step: minutes, no more coverage).
SHAR_CUTS = 96
COMMON = ("seed=4", "train.max_steps=6", "train.log_every=1", "eval.interval=3")
COMMON += ("data.num_workers=1", "data.max_duration=6", "wandb.enabled=false")
# The mixture's stream is endless: the sampler's buffer is filled before the first batch, with
# each cut's audio (at lhotse's 20,000, ~200 passes over the bucket's 96 cuts: 4 minutes here).
COMMON += ("data.buffer_size=500",)


@dataclass(frozen=True)
class Runs:
    store: ObjectStore
    sources: Path  # the local source files naming the bucket's data
    whole: Path  # one job of 6 steps
    resumed: Path  # two jobs of 3


def put_data(store: ObjectStore, corpus: Path, work: Path) -> None:
    """The corpus's first SHAR_CUTS training cuts as a Shar (audio as FLAC shards, no features:
    the encoder's features are computed from the streamed audio), and 8 dev cuts as a manifest
    whose recordings are URLs of their WAV files in the bucket."""
    train_cuts = CutSet.from_file(corpus / "cuts_train.jsonl.gz").subset(first=SHAR_CUTS)
    train_cuts = train_cuts.with_recording_path_prefix(corpus)
    (work / "shar").mkdir()
    train_cuts.drop_features().to_shar(work / "shar", fields={"recording": "flac"}, shard_size=16)
    store.upload(work / "shar", SHAR)
    dev = CutSet.from_file(corpus / "cuts_dev.jsonl.gz").subset(first=8).drop_features()
    remote = []
    for cut in dev:
        [source] = cut.recording.sources
        url = f"s3://{BUCKET}/wavs/{Path(source.source).name}"
        store.upload(corpus / source.source, url)
        source.type, source.source = "url", url
        remote.append(cut)
    CutSet.from_cuts(remote).to_file(work / "dev.jsonl.gz")
    store.upload(work / "dev.jsonl.gz", DEV)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Iterator[Runs]:
    work = tmp_path_factory.mktemp("object_storage")
    with object_store(work / "store", (BUCKET,)) as store:
        put_data(store, corpus, work)
        sources = work / "sources"
        sources.mkdir()
        (sources / "input_cfg.yaml").write_text(f"- shar: {SHAR}\n  name: train\n")
        (sources / "eval_sets.yaml").write_text(f"- cuts: {DEV}\n  name: dev\n")
        common = (
            *COMMON,
            f"data.input_cfg={sources / 'input_cfg.yaml'}",
            f"eval.sets={sources / 'eval_sets.yaml'}",
        )
        whole, resumed = work / "whole", work / "resumed"
        first = (*common, "train.max_steps_per_run=3")
        env = store.env()
        train_together({resumed: first, whole: common}, corpus, 2, env=env)
        train(resumed, corpus, *common, nproc=2, env=env)
        yield Runs(store, sources, whole, resumed)


@pytest.mark.slow
def test_a_shar_in_object_storage_trains_and_resumes_bit_for_bit(runs: Runs) -> None:
    whole, resumed = metrics(runs.whole), metrics(runs.resumed)
    losses = [(row["step"], row["loss"]) for row in whole if "loss" in row]
    assert [step for step, _ in losses] == [1, 2, 3, 4, 5, 6]
    assert [(row["step"], row["loss"]) for row in resumed if "loss" in row] == losses
    validation = [(row["step"], row["val_loss"]) for row in whole if "val_loss" in row]
    assert [(row["step"], row["val_loss"]) for row in resumed if "val_loss" in row][-1] == (
        validation[-1]
    )
    read = runs.store.gets()
    assert any("/shar/train/recording." in url for url in read), read
    assert any("/wavs/" in url for url in read), read


def test_no_file_a_run_writes_holds_the_secret(runs: Runs) -> None:
    written = [p for run in (runs.whole, runs.resumed) for p in run.rglob("*") if p.is_file()]
    assert written
    holding = [p for p in written if SECRET_KEY.encode() in p.read_bytes()]
    assert holding == []


def test_the_start_check_reads_no_audio(runs: Runs, monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.planner.plan_check import compose_training_config
    from train.trainer import preflight

    for key, value in runs.store.env().items():
        monkeypatch.setenv(key, value)
    before = len(runs.store.gets())
    overrides = train_overrides(runs.whole.parent / "checked", Path("unused"), *COMMON)
    overrides += [f"data.input_cfg={runs.sources / 'input_cfg.yaml'}"]
    overrides += [f"eval.sets={runs.sources / 'eval_sets.yaml'}"]
    preflight(compose_training_config(overrides))
    read = runs.store.gets()[before:]
    assert read and all("/shar/train/cuts." in url or url == DEV for url in read), read


@pytest.mark.parametrize(
    ("location", "env", "said"),
    [
        ("s3://nobucket/shar", {}, "bucket 'nobucket' does not exist"),
        ("s3://speech/shar/none", {}, "no object under this prefix"),
        (SHAR, {"AWS_SECRET_ACCESS_KEY": "wrong-secret"}, "access refused"),
        (SHAR, {"AWS_ENDPOINT_URL": "closed"}, "the endpoint cannot be reached"),
        ("ais://speech/shar", {}, "AIStore"),
    ],
    ids=["no_bucket", "no_prefix", "wrong_secret", "no_endpoint", "ais"],
)
def test_a_location_that_cannot_be_read_is_one_line(
    runs: Runs, monkeypatch: pytest.MonkeyPatch, location: str, env: dict, said: str
) -> None:
    if env.get("AWS_ENDPOINT_URL") == "closed":
        env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}
    for key, value in runs.store.env(**env).items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SourceError) as refused:
        read_sources([{"shar": location}], "data.input_cfg")
    line = str(refused.value)
    assert said in line and "\n" not in line and SECRET_KEY not in line, line


@pytest.mark.slow
def test_the_trainer_refuses_a_wrong_secret_before_it_starts(
    runs: Runs, corpus: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    done = train(
        run_dir,
        corpus,
        *COMMON,
        f"data.input_cfg={runs.sources / 'input_cfg.yaml'}",
        env=runs.store.env(AWS_SECRET_ACCESS_KEY="wrong-secret"),
        check=False,
    )
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-3000:]
    assert "access refused" in errors[0] and SHAR in errors[0]
    assert "Traceback" not in done.stderr and not (run_dir / "metrics.jsonl").exists()


def test_a_nemo_shar_path_given_by_fields_streams_the_same_audio(
    runs: Runs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NeMo's ``shar_path: {cuts: [...], recording: [...]}`` with the shards' URLs: the audio
    streamed from the bucket is the audio lhotse wrote."""
    for key, value in runs.store.env().items():
        monkeypatch.setenv(key, value)
    fields = {name: [str(u) for u in urls] for name, urls in shar_shards(SHAR).items()}
    entry = {"type": "lhotse_shar", "shar_path": fields}
    [source] = read_sources([entry], "data.input_cfg")
    assert source.paths == tuple(fields["cuts"])
    streamed = next(iter(load_source_cuts(source)))
    written = next(iter(CutSet.from_shar(in_dir=runs.sources.parent / "shar")))
    assert streamed.id == written.id
    assert (streamed.load_audio() == written.load_audio()).all()
