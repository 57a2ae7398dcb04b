"""The espeak-ng corpus recipe: real synthesis, real lhotse manifests, features and Shar shards."""

import importlib.util
import shutil
from pathlib import Path

import pytest
from lhotse import CutSet, RecordingSet

from tests.helpers import run_script
from train.data import load_cuts

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "recipes" / "make_corpus.py"
TINY = ["--num", "16", "--jobs", "2", "--shard-size", "4"]


def run_make_corpus(out: Path, *args: str, path_env: str | None = None):
    env = {} if path_env is None else {"PATH": path_env}
    return run_script(SCRIPT, "--out", str(out), *args, env=env)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A 16-utterance corpus, made once (test_data_seeds reuses the same path: a no-op rerun)."""
    out = tmp_path_factory.getbasetemp() / "tiny_corpus"
    result = run_make_corpus(out, *TINY)
    assert result.returncode == 0, result.stderr
    return out


def load_recipe():
    spec = importlib.util.spec_from_file_location("make_corpus", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_manifests_hold_16khz_audio_and_80_bin_features(corpus):
    train = CutSet.from_file(corpus / "cuts_train.jsonl.gz")
    dev = CutSet.from_file(corpus / "cuts_dev.jsonl.gz")
    assert (len(train), len(dev)) == (14, 2)
    assert not set(train.ids) & set(dev.ids)
    recordings = RecordingSet.from_file(corpus / "recordings.jsonl.gz")
    assert len(recordings) == 16
    assert {r.sampling_rate for r in recordings} == {16000}
    for cut in load_cuts(corpus / "cuts_train.jsonl.gz"):
        assert 0.3 < cut.duration < 10.0
        assert cut.supervisions[0].text
        audio = cut.load_audio()
        assert audio.shape[0] == 1
        assert abs(audio.shape[1] / 16000 - cut.duration) < 0.01
        feats = cut.load_features()
        assert feats.shape == (cut.num_frames, 80)
        assert abs(cut.num_frames - cut.duration * 100) <= 2


def test_texts_follow_the_seeded_plan(corpus):
    plan = load_recipe().plan_utterances(16, seed=0)
    cuts = CutSet.from_file(corpus / "cuts_train.jsonl.gz") + CutSet.from_file(
        corpus / "cuts_dev.jsonl.gz"
    )
    spoken = {c.id: (c.supervisions[0].text, c.supervisions[0].speaker) for c in cuts}
    assert spoken == {u.utt_id: (u.text, u.voice) for u in plan}
    assert len({u.voice for u in plan}) > 1
    assert len({u.speed for u in plan}) > 1


def test_shar_shards_are_readable(corpus):
    shar = CutSet.from_shar(in_dir=corpus / "shar" / "train")
    ids = []
    for cut in shar:
        ids.append(cut.id)
        assert cut.load_features().shape == (cut.num_frames, 80)
        assert cut.load_audio().shape[1] == cut.recording.num_samples
    assert sorted(ids) == sorted(CutSet.from_file(corpus / "cuts_train.jsonl.gz").ids)
    assert len(list((corpus / "shar" / "train").glob("cuts.*.jsonl.gz"))) == 4


def test_rerun_is_a_no_op(corpus):
    marker = corpus / "COMPLETE.json"
    before = marker.stat().st_mtime_ns
    result = run_make_corpus(corpus, *TINY)
    assert result.returncode == 0, result.stderr
    assert "complete already" in result.stdout
    assert marker.stat().st_mtime_ns == before


def test_other_settings_over_a_complete_corpus_are_refused(corpus):
    result = run_make_corpus(corpus, "--num", "24", "--jobs", "2", "--shard-size", "4")
    assert result.returncode == 2
    assert "pass another --out" in result.stderr


def test_directory_without_marker_is_never_taken_as_complete(tmp_path):
    partial = tmp_path / "corpus"
    (partial / "wavs").mkdir(parents=True)
    result = run_make_corpus(partial, *TINY)
    assert result.returncode == 2
    assert "not a complete corpus" in result.stderr
    assert not (partial / "COMPLETE.json").exists()


def test_missing_espeak_ng_says_run_make_setup(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sox").symlink_to(shutil.which("sox"))
    result = run_make_corpus(tmp_path / "corpus", *TINY, path_env=str(bin_dir))
    assert result.returncode == 2
    assert "espeak-ng not found on PATH: run make setup" in result.stderr
    assert not (tmp_path / "corpus").exists()
    assert not list(tmp_path.glob(".corpus.tmp-*"))
