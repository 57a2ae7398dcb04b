"""The LibriSpeech-layout recipe: espeak-ng audio in LibriSpeech's own folders, prepared by
lhotse's own ``lhotse prepare librispeech`` and read back as a user's own data would be."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile
from lhotse import CutSet, RecordingSet, SupervisionSet

from recipes.make_corpus import Utterance, is_test_text
from recipes.make_librispeech import plan_librispeech
from tests.harness.corpora import LIBRISPEECH_UTTERANCES as UTTERANCES
from tests.harness.process import REPO

PARTS = ("train-clean-100", "dev-clean", "test-clean")
# lhotse's own file names, spelled out here so that a change in lhotse shows up as a failure.
MANIFESTS = sorted(
    f"librispeech_{kind}_{part}.jsonl.gz"
    for kind in ("recordings", "supervisions")
    for part in PARTS
)


def command(out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "recipes.make_librispeech", "--out", str(out), *args]


def run_recipe(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m recipes.make_librispeech`` from the repository root, as a user runs it."""
    return subprocess.run(
        command(out, *args),
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=120,
    )


@pytest.fixture(scope="module")
def corpus(librispeech: Path) -> Path:
    """The session's LibriSpeech-layout corpus (tests/conftest.py)."""
    return librispeech


@pytest.fixture(scope="module")
def plan() -> dict[str, list[Utterance]]:
    return plan_librispeech(UTTERANCES, seed=0)


def load(corpus: Path, part: str) -> tuple[RecordingSet, SupervisionSet]:
    manifests = corpus / "manifests"
    return (
        RecordingSet.from_file(manifests / f"librispeech_recordings_{part}.jsonl.gz"),
        SupervisionSet.from_file(manifests / f"librispeech_supervisions_{part}.jsonl.gz"),
    )


def test_folders_and_transcripts_are_librispeechs(corpus, plan):
    """Tools other than lhotse (icefall, NeMo's scripts) read LibriSpeech by these rules; lhotse
    alone would accept lowercase text, gaps in the numbering, stray files and 22 kHz audio."""
    assert sorted(p.name for p in corpus.parent.iterdir()) == ["corpus"]  # no partial left
    assert sorted(p.name for p in corpus.iterdir()) == ["LibriSpeech", "manifests"]
    root = corpus / "LibriSpeech"
    assert sorted(p.name for p in root.iterdir()) == sorted(PARTS)
    transcripts: dict[str, dict[str, str]] = {}
    speakers: dict[str, set[str]] = {}
    for part in PARTS:
        transcripts[part] = {}
        speakers[part] = {p.name for p in (root / part).iterdir()}
        assert len(speakers[part]) >= 2
        for chapter in (root / part).glob("*/*"):
            assert chapter.parent.name.isdigit() and chapter.name.isdigit()
            prefix = f"{chapter.parent.name}-{chapter.name}"
            lines = (chapter / f"{prefix}.trans.txt").read_text().splitlines()
            ids = [line.split(" ", 1)[0] for line in lines]
            assert ids == [f"{prefix}-{i:04d}" for i in range(len(lines))]
            assert all(re.fullmatch(r"\S+ [A-Z]+( [A-Z]+)*", line) for line in lines)
            files = sorted(p.name for p in chapter.iterdir())
            assert files == sorted([f"{prefix}.trans.txt"] + [f"{i}.flac" for i in ids])
            for utt_id in ids:
                info = soundfile.info(chapter / f"{utt_id}.flac")
                assert (info.format, info.subtype) == ("FLAC", "PCM_16")
                assert (info.samplerate, info.channels) == (16000, 1)
            transcripts[part].update(line.split(" ", 1) for line in lines)
    assert not speakers["train-clean-100"] & (speakers["dev-clean"] | speakers["test-clean"])
    assert not speakers["dev-clean"] & speakers["test-clean"]
    # The plan made in this process is the one spoken in the recipe's: a seeded plan.
    assert transcripts == {
        part: {u.utt_id: u.text.upper() for u in utterances} for part, utterances in plan.items()
    }
    assert {part: len(t) for part, t in transcripts.items()} == {
        "train-clean-100": 12,
        "dev-clean": 4,
        "test-clean": 4,
    }


def test_lhotse_prepared_every_utterance_with_absolute_paths(corpus, plan):
    """Manifests that miss utterances or point at relative paths break training launched from
    another directory (a SLURM job's working directory is not the data's)."""
    assert sorted(p.name for p in (corpus / "manifests").iterdir()) == MANIFESTS
    for part, utterances in plan.items():
        recordings, supervisions = load(corpus, part)
        assert sorted(recordings.ids) == sorted(u.utt_id for u in utterances)
        assert {s.id: s.text for s in supervisions} == {
            u.utt_id: u.text.upper() for u in utterances
        }
        assert {s.id: s.speaker for s in supervisions} == {
            u.utt_id: u.utt_id.split("-")[0] for u in utterances
        }
        for recording in recordings:
            speaker, chapter, _ = recording.id.split("-")
            source = Path(recording.sources[0].source)
            assert source.is_absolute()
            assert (
                source == corpus / "LibriSpeech" / part / speaker / chapter / f"{recording.id}.flac"
            )


def test_cuts_from_lhotse_manifests_load_16khz_speech(corpus):
    """What the data pipeline does with a user's own manifests: cuts whose audio is there,
    at 16 kHz, as long as its supervision, and not silent."""
    for part in PARTS:
        recordings, supervisions = load(corpus, part)
        cuts = CutSet.from_manifests(recordings=recordings, supervisions=supervisions)
        assert len(cuts) == len(recordings)
        for cut in cuts:
            assert cut.sampling_rate == 16000
            assert 0.5 < cut.duration < 10.0
            assert [s.duration for s in cut.supervisions] == [cut.duration]
            audio = cut.load_audio()
            assert audio.shape == (1, round(cut.duration * 16000))
            assert np.abs(audio).max() > 0.05


def test_test_clean_speaks_only_sentences_held_out_of_every_train_split(corpus):
    """A model trained on train-clean-100 and the project corpus must not have heard test-clean's
    sentences, nor the project corpus's test sentences."""
    for part in PARTS:
        _, supervisions = load(corpus, part)
        held_out = {is_test_text(s.text.lower()) for s in supervisions}
        assert held_out == {part == "test-clean"}


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ((), "exists and is not empty: delete it or pick another --out"),
        (("--utterances", "15"), "--utterances must be at least 16"),
    ],
    ids=["rerun-over-finished-corpus", "too-few-utterances"],
)
def test_refusals_leave_the_corpus_as_it_was(corpus, tmp_path, args, error):
    """Running the recipe again (or with a corpus too small to fill every chapter) must say why
    in one line and exit 2, without touching a finished corpus."""
    out = corpus if not args else tmp_path / "corpus"
    before = {p: p.stat().st_mtime_ns for p in corpus.rglob("*")}
    result = run_recipe(out, *args)
    assert result.returncode == 2
    assert error in result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr
    assert {p: p.stat().st_mtime_ns for p in corpus.rglob("*")} == before
    assert sorted(p.name for p in corpus.parent.iterdir()) == ["corpus"]
    assert not (tmp_path / "corpus").exists()


def test_interrupted_run_leaves_nothing_behind(tmp_path):
    """Ctrl-C during synthesis (SIGINT to the whole process group, as a terminal sends it) must
    not leave a directory that the Makefile's check or a rerun would take for a corpus."""
    out = tmp_path / "corpus"
    process = subprocess.Popen(
        command(out, "--utterances", "300", "--jobs", "2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,
        # As from a terminal: a suite started in the background (`make test &`) ignores SIGINT,
        # and a Python started with it ignored never raises KeyboardInterrupt.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    for line in process.stdout:
        if "/300 utterances" in line:  # the first chunk synthesized; most are still to come
            os.killpg(process.pid, signal.SIGINT)
            break
    _, stderr = process.communicate(timeout=60)
    assert process.returncode != 0
    assert "KeyboardInterrupt" in stderr
    assert list(tmp_path.iterdir()) == []
