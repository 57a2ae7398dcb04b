"""The espeak-ng corpus recipe: real synthesis, real lhotse manifests, features and Shar shards."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from lhotse import CutSet, RecordingSet

from tests.harness.process import REPO, run_script
from train.data.loader import load_cuts

SCRIPT = REPO / "recipes" / "make_corpus.py"
TINY = ["--num", "16", "--jobs", "2", "--shard-size", "4"]
SPLITS = ("train", "dev", "test")


def run_make_corpus(out: Path, *args: str, path_env: str | None = None):
    env = {} if path_env is None else {"PATH": path_env}
    return run_script(SCRIPT, "--out", str(out), *args, env=env)


@pytest.fixture(scope="module")
def corpus(tiny_corpus: Path) -> Path:
    """The session's 16-utterance corpus (tests/conftest.py)."""
    return tiny_corpus


def load_recipe():
    spec = importlib.util.spec_from_file_location("make_corpus", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


recipe = load_recipe()


def split_cuts(corpus: Path) -> dict[str, CutSet]:
    return {split: CutSet.from_file(corpus / f"cuts_{split}.jsonl.gz") for split in SPLITS}


def texts(cuts: CutSet) -> set[str]:
    return {c.supervisions[0].text for c in cuts}


def test_manifests_hold_16khz_audio_and_80_bin_features(corpus):
    splits = split_cuts(corpus)
    assert {split: len(cuts) for split, cuts in splits.items()} == {
        "train": 13,
        "dev": 1,
        "test": 2,
    }
    ids = [cut_id for cuts in splits.values() for cut_id in cuts.ids]
    assert len(set(ids)) == len(ids) == 16
    done = json.loads((corpus / "COMPLETE.json").read_text())
    assert (done["num"], done["train"], done["dev"], done["test"]) == (16, 13, 1, 2)
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
    plan = recipe.plan_utterances(16, seed=0)
    cuts = [cut for cuts in split_cuts(corpus).values() for cut in cuts]
    spoken = {c.id: (c.supervisions[0].text, c.supervisions[0].speaker) for c in cuts}
    assert spoken == {u.utt_id: (u.text, u.voice) for u in plan}
    assert len({u.voice for u in plan}) > 1
    assert len({u.speed for u in plan}) > 1


def test_no_test_text_occurs_in_train_or_dev(corpus):
    splits = split_cuts(corpus)
    assert texts(splits["test"])
    assert not texts(splits["test"]) & (texts(splits["train"]) | texts(splits["dev"]))


def test_split_plan_holds_whole_sentences_out():
    plan = recipe.plan_utterances(600, seed=0)
    splits = recipe.assign_splits(plan)
    by_split = {s: [u for u in plan if splits[u.utt_id] == s] for s in SPLITS}
    held_out = {u.text for u in by_split["test"]}
    assert len({u.text for u in plan}) < len(plan), "the plan should repeat some sentences"
    assert not held_out & {u.text for u in by_split["train"] + by_split["dev"]}
    assert 0.06 < len(held_out) / len({u.text for u in plan}) < 0.14
    kept = [u.utt_id for u in plan if splits[u.utt_id] != "test"]
    assert [u.utt_id for u in by_split["dev"]] == kept[7::8]


def test_test_texts_are_the_same_in_every_process():
    # Pinned: Python's salted hash() would move sentences between splits from run to run.
    plan = recipe.plan_utterances(16, seed=0)
    held_out = [u.text for u in plan if recipe.is_test_text(u.text)]
    assert held_out == ["call eight seven seven eight", "call two eight seven one"]


@pytest.mark.parametrize(
    ("num", "seed", "empty"), [("8", "0", "puts no utterance in dev"), ("16", "1", "in test")]
)
def test_a_plan_with_an_empty_split_is_refused(tmp_path, capsys, num, seed, empty):
    out = tmp_path / "corpus"
    assert recipe.main(["--out", str(out), "--num", num, "--seed", seed]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"make_corpus: error: --num {num} --seed {seed} ")
    assert empty in err and "pass a larger --num" in err
    assert not out.exists() and not list(tmp_path.glob(".corpus.tmp-*"))


def test_a_corpus_without_a_test_split_is_refused(tmp_path, capsys):
    old = tmp_path / "corpus"
    old.mkdir()
    marker = old / "COMPLETE.json"
    marker.write_text(json.dumps({"settings": {"num": 16, "seed": 0, "shard_size": 4}}))
    assert recipe.main(["--out", str(old), *TINY]) == 2
    err = capsys.readouterr().err
    assert "has no test split (cuts_test.jsonl.gz): delete" in err
    assert [p.name for p in old.iterdir()] == ["COMPLETE.json"]


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
