"""docs/training.md's "Your own data" walk-through, small: a corpus in LibriSpeech's own layout
prepared by lhotse's own recipe, mixed 0.7/0.3 with the project's corpus through the shipped
source files (recipes/mix/), trained on 2 ranks with features computed from audio, validated per
set, and both test sets scored in one evaluation; and a bad source file refused before training.

The 2-rank trainings of the mixture (the walk-through's first 3-step job and its 6-step job, and
the pretrained Whisper encoder's run) are one process group's runs, one after another
(tests/harness/workers/trainer_runs_worker.py): the ranks' start-up is paid once for the module,
and each test reads its own run dirs. The walk-through's second 3-step job is a ``python -m
train`` of its own, as a chain's next job is: it resumes from the checkpoint alone."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from transformers import WhisperFeatureExtractor

from tests.harness.hf_tiny import save_tiny_encoder
from tests.harness.process import REPO, run_python
from tests.harness.training import metrics, run_ranks, train, train_overrides


def make_data(root: Path, corpus: Path, librispeech: Path) -> Path:
    """data/ as `make mix` leaves it: the two corpora beside mix/ with the shipped source files."""
    data = root / "data"
    (data / "mix").mkdir(parents=True)
    (data / "librispeech").symlink_to(librispeech)
    (data / "corpus_asr").symlink_to(corpus)
    for path in (REPO / "recipes" / "mix").glob("*.yaml"):
        shutil.copy(path, data / "mix")
    return data


@pytest.fixture
def data(tmp_path, corpus, librispeech) -> Path:
    """The test's own data/ (make_data)."""
    return make_data(tmp_path, corpus, librispeech)


def evaluate(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    command = ["-m", "train.evaluate", f"run_dir={run_dir}", *overrides]
    return run_python(command, 1, dict(os.environ))


@dataclass(frozen=True)
class MixRuns:
    """The module's 2-rank trainings of the mixture, and what their ranks printed."""

    data: Path
    whole: Path  # the walk-through in one job of 6 steps
    run: Path  # the same in two jobs of 3 (two processes), validated
    features: Path  # the walk-through's feature cache
    whisper: Path  # the pretrained Whisper encoder's run
    encoder: Path
    stderr: str  # the process group's
    resumed: str  # the second 3-step job's


@pytest.fixture(scope="module")
def mix_runs(tmp_path_factory, corpus, librispeech) -> MixRuns:
    """The walk-through's runs (one job of 6 steps; two of 3 from the same seed) and the
    pretrained Whisper encoder's run: the first job of 3 (first, as a chain's first job starts
    in a fresh process), the job of 6 and Whisper's run one after another by one group of 2
    ranks, then the second job of 3 by 2 ranks of its own."""
    root = tmp_path_factory.mktemp("mix_runs")
    data = make_data(root, corpus, librispeech)
    whole, run_dir, cache = root / "whole", root / "run", root / "features"
    common = (
        "seed=3",
        f"data.input_cfg={data / 'mix' / 'input_cfg.yaml'}",
        f"data.feature_cache={cache}",
        f"eval.sets={data / 'mix' / 'eval_sets.yaml'}",
        "data.max_duration=6",
        "train.max_steps=6",
        "train.log_every=3",
        "train.max_time_per_run=0",
        "wandb.enabled=false",
    )
    encoder = save_tiny_encoder("whisper", root / "whisper_encoder")
    whisper = root / "whisper"
    runs = [
        train_overrides(run_dir, corpus, *common, "eval.interval=3", "train.max_steps_per_run=3"),
        train_overrides(whole, corpus, *common, "eval.interval=0"),
        train_overrides(whisper, corpus, *pretrained_overrides(encoder, data)),
    ]
    spec = root / "runs.json"
    spec.write_text(json.dumps({"config": "asr_mix", "runs": runs}))
    done = run_ranks(["-m", "tests.harness.workers.trainer_runs_worker", str(spec)], 2)
    second = train(run_dir, corpus, *common, "eval.interval=3", nproc=2, config="asr_mix")
    return MixRuns(data, whole, run_dir, cache, whisper, encoder, done.stderr, second.stderr)


def pretrained_overrides(encoder: Path, data: Path) -> tuple[str, ...]:
    """A pretrained encoder's 4 steps on the mixture, validated every 2."""
    return (
        f"model.pretrained_encoder={encoder}",
        "model.projector_stride=2",
        f"data.input_cfg={data / 'mix' / 'input_cfg.yaml'}",
        f"data.feature_cache={data / 'features'}",  # not the recipe's, under the checkout
        f"eval.sets={data / 'mix' / 'eval_sets.yaml'}",
        "data.max_duration=6",
        "train.max_steps=4",
        "train.log_every=2",
        "train.max_time_per_run=0",
        "eval.interval=2",
        "wandb.enabled=false",
    )


@pytest.mark.slow
def test_a_librispeech_layout_mixed_with_the_corpus_trains_resumes_validates_and_evaluates(
    mix_runs,
):
    """The walk-through on 2 ranks: one job of 6 steps equals two jobs of 3 in two processes
    (same seed) in every loss, although LibriSpeech's features are computed from its audio in
    the workers (and cached); each row counts the cuts per source, validation is logged per
    set, and one evaluation scores both test sets."""
    data, whole, run_dir, cache = mix_runs.data, mix_runs.whole, mix_runs.run, mix_runs.features
    assert f"resumed from {run_dir}/checkpoints/step_3 at step 3" in mix_runs.resumed
    losses = [(row["step"], row["loss"]) for row in metrics(whole) if "loss" in row]
    rows = metrics(run_dir)
    trained = [row for row in rows if "loss" in row]
    assert [(row["step"], row["loss"]) for row in trained] == losses
    drawn = {
        name: sum(row[f"cuts/{name}"] for row in trained) for name in ("librispeech", "corpus")
    }
    assert drawn["librispeech"] > 0 and drawn["corpus"] > 0, drawn
    assert all(row["skipped_cuts"] == 0 for row in trained)
    # LibriSpeech's manifests carry audio only: its features were computed and cached.
    assert len(list(cache.rglob("*.npy"))) >= drawn["librispeech"] // 4
    validation = [row for row in rows if "val_loss" in row]
    assert [row["step"] for row in validation] == [3, 6]
    for row in validation:
        assert row["val_split"] == "librispeech_dev,corpus_dev"
        each = [row["val_loss/librispeech_dev"], row["val_loss/corpus_dev"]]
        assert min(each) <= row["val_loss"] <= max(each)

    scored = evaluate(run_dir, f"sets={data / 'mix' / 'test_sets.yaml'}", "max_new_tokens=8")
    assert scored.returncode == 0, scored.stderr[-3000:]
    summary = json.loads((run_dir / "eval" / "step_6" / "summary.json").read_text())
    assert set(summary["sets"]) == {"librispeech_test", "corpus_test"}
    assert summary["sets"]["librispeech_test"]["num_utterances"] == 4
    assert sum(s["num_utterances"] for s in summary["sets"].values()) == summary["num_utterances"]


def test_a_bad_source_file_stops_training_before_it_starts(tmp_path, corpus, data):
    """A weight of 0 in the user's file: one error line, exit 2, nothing trained."""
    bad = data / "mix" / "bad.yaml"
    bad.write_text(
        (data / "mix" / "input_cfg.yaml").read_text().replace("weight: 0.3", "weight: 0")
    )
    run_dir = tmp_path / "run"
    result = train(run_dir, corpus, f"data.input_cfg={bad}", config="asr_mix", check=False)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: data.input_cfg={bad}: source corpus has weight 0; weights must be positive "
        "(remove the source instead of giving it weight 0)"
    ]
    assert not (run_dir / "checkpoints").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind", ["whisper", "parakeet"], ids=["whisper-fsdp2", "parakeet-compiled"]
)
def test_a_pretrained_encoder_trains_on_the_mixture_and_evaluates(request, tmp_path, corpus, kind):
    """A user's Hugging Face encoder on their own data: its extractor's features computed from
    the audio in the workers (the corpus's stored fbank is not what it reads), real batches of
    varying shapes, validation per set. Whisper's run (FSDP2 on 2 ranks, the module's process
    group) then evaluates both test sets from the checkpoint; Parakeet trains on one rank,
    compiled (aot_eager) with full activation checkpointing."""
    if kind == "whisper":
        runs: MixRuns = request.getfixturevalue("mix_runs")
        data, encoder, run_dir, stderr = runs.data, runs.encoder, runs.whisper, runs.stderr
    else:
        data = make_data(tmp_path, corpus, request.getfixturevalue("librispeech"))
        encoder = save_tiny_encoder(kind, tmp_path / kind)
        run_dir = tmp_path / "run"
        compiled = ("compile=true", "compile_backend=aot_eager", "activation_checkpointing=full")
        overrides = (*pretrained_overrides(encoder, data), *compiled)
        stderr = train(run_dir, corpus, *overrides, nproc=1, config="asr_mix").stderr
    assert f"encoder weights loaded from {encoder}" in stderr
    rows = metrics(run_dir)
    assert [row["step"] for row in rows if "loss" in row] == [2, 4]
    validation = [row for row in rows if "val_loss" in row]
    assert [row["step"] for row in validation] == [2, 4]
    assert all(math.isfinite(row["val_loss/corpus_dev"]) for row in validation)
    if kind == "whisper":  # its extractor's features of both test sets, from the checkpoint
        scored = evaluate(run_dir, f"sets={data / 'mix' / 'test_sets.yaml'}", "max_new_tokens=4")
        assert scored.returncode == 0, scored.stderr[-3000:]
        summary = json.loads((run_dir / "eval" / "step_4" / "summary.json").read_text())
        assert set(summary["sets"]) == {"librispeech_test", "corpus_test"}


def test_an_extractor_that_does_not_fit_the_encoder_is_refused(tmp_path, corpus, data):
    """A Whisper checkpoint with 128-bin weights beside an 80-bin extractor (a large-v3 encoder
    saved with an older model's preprocessor_config.json): one line, exit 2."""
    encoder = save_tiny_encoder("whisper", tmp_path / "whisper")
    WhisperFeatureExtractor(feature_size=128).save_pretrained(encoder)
    result = train(
        tmp_path / "run",
        corpus,
        f"model.pretrained_encoder={encoder}",
        f"data.input_cfg={data / 'mix' / 'input_cfg.yaml'}",
        config="asr_mix",
        check=False,
    )
    assert result.returncode == 2
    [error] = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert "makes 128 bins per frame but the encoder takes 80" in error
