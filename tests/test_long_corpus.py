"""The long-utterance corpus recipe: joined features and transcripts, read by
train/data/loader.py."""

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from lhotse import CutSet

from tests.harness.process import REPO, run_script
from train.data.loader import build_dataloader, load_cuts
from train.data.text import ByteTokenizer

SCRIPT = REPO / "recipes" / "make_long_corpus.py"
JOIN = 4
SPLITS = ("train", "dev")
PAD_ID = 256


def load_recipe():
    spec = importlib.util.spec_from_file_location("make_long_corpus", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


recipe = load_recipe()


def run_make_long_corpus(corpus: Path, out: Path, *args: str):
    return run_script(SCRIPT, "--corpus", str(corpus), "--out", str(out), *args)


@pytest.fixture(scope="module")
def long_corpus(corpus, tmp_path_factory) -> Path:
    """The fixture corpus with every 4 consecutive cuts joined, made once as a user runs it."""
    out = tmp_path_factory.mktemp("long") / "corpus_long"
    result = run_make_long_corpus(corpus, out, "--join", str(JOIN))
    assert result.returncode == 0, result.stderr
    assert "make_long_corpus: train" in result.stdout
    return out


def source_cuts(corpus: Path, split: str) -> list:
    return list(load_cuts(corpus / f"cuts_{split}.jsonl.gz"))


def text(cut) -> str:
    return " ".join(s.text for s in cut.supervisions)


def test_one_long_cut_per_full_group(corpus, long_corpus):
    for split in SPLITS:
        n = len(source_cuts(corpus, split))
        assert len(CutSet.from_file(long_corpus / f"cuts_{split}.jsonl.gz")) == n // JOIN
    assert (long_corpus / "COMPLETE.json").exists()
    assert not list(long_corpus.parent.glob(".corpus_long.tmp-*"))


def test_long_cuts_hold_their_sources_back_to_back(corpus, long_corpus, tmp_path):
    # A moved copy still reads: the manifests' paths are relative to the corpus.
    moved = tmp_path / "moved"
    shutil.copytree(long_corpus, moved)
    for split in SPLITS:
        sources = source_cuts(corpus, split)
        raw = CutSet.from_file(moved / f"cuts_{split}.jsonl.gz")
        assert {c.features.storage_path for c in raw} == {"feats"}
        assert all(not c.has_recording for c in raw)
        for i, cut in enumerate(load_cuts(moved / f"cuts_{split}.jsonl.gz")):
            group = sources[i * JOIN : (i + 1) * JOIN]
            assert cut.custom["source_cuts"] == [c.id for c in group]
            expected = np.concatenate([c.load_features() for c in group])
            feats = cut.load_features()
            assert feats.dtype == np.float32
            np.testing.assert_array_equal(feats, expected)
            assert cut.num_frames == feats.shape[0]
            assert cut.duration == pytest.approx(feats.shape[0] * 0.01)
            assert text(cut) == " ".join(text(c) for c in group)


def test_dataloader_yields_batches_four_times_as_long(corpus, long_corpus):
    source = {c.id: c for c in source_cuts(corpus, "train")}
    long_cuts = {c.id: c for c in load_cuts(long_corpus / "cuts_train.jsonl.gz")}
    loader = build_dataloader(
        long_corpus / "cuts_train.jsonl.gz",
        max_duration=40.0,
        job_seed=0,
        dp_rank=0,
        dp_size=1,
        num_workers=0,
        text=ByteTokenizer(),
        buckets=2,
    )
    lens = []
    for batch in loader:
        assert batch["features"].shape[3] == 80
        for cut_id, n_frames, n_tokens in zip(
            batch["cut_ids"],
            batch["feature_lens"][:, 0].tolist(),
            batch["token_lens"].tolist(),
            strict=True,
        ):
            group = [source[i] for i in long_cuts[cut_id].custom["source_cuts"]]
            assert n_frames == sum(c.num_frames for c in group)
            assert n_tokens == len(ByteTokenizer().encode(" ".join(text(c) for c in group)))
            lens.append(n_frames)
    assert len(lens) >= len(long_cuts) // 2, "the long corpus gave (almost) no batches"
    source_mean = np.mean([c.num_frames for c in source.values()])
    assert 3.0 < np.mean(lens) / source_mean < 5.0


def test_missing_source_is_refused_with_one_line_and_nothing_left(tmp_path):
    out = tmp_path / "out" / "corpus_long"
    result = run_make_long_corpus(tmp_path / "no_corpus", out, "--join", str(JOIN))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("make_long_corpus: error: source corpus ")
    assert "does not exist" in result.stderr
    assert not (tmp_path / "out").exists()


def test_unfinished_source_is_refused(corpus, tmp_path, capsys):
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(corpus / "cuts_train.jsonl.gz", partial)  # manifests but no COMPLETE.json
    out = tmp_path / "corpus_long"
    assert recipe.main(["--corpus", str(partial), "--out", str(out), "--join", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no COMPLETE.json" in err
    assert not out.exists() and not list(tmp_path.glob(".corpus_long.tmp-*"))


def test_split_smaller_than_join_is_refused(corpus, tmp_path, capsys):
    out = tmp_path / "corpus_long"
    n_dev = len(source_cuts(corpus, "dev"))
    argv = ["--corpus", str(corpus), "--out", str(out), "--join", str(n_dev + 1)]
    assert recipe.main(argv) == 2
    assert f"fewer than --join {n_dev + 1}" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".corpus_long.tmp-*"))


def test_leftover_cuts_are_dropped_and_counted(corpus, tmp_path, capsys):
    out = tmp_path / "corpus_long"
    n_dev = len(source_cuts(corpus, "dev"))
    join = n_dev - 1  # one full group, the rest left over
    argv = ["--corpus", str(corpus), "--out", str(out), "--join", str(join), "--splits", "dev"]
    assert recipe.main(argv) == 0
    assert "1 left over cut(s) dropped" in capsys.readouterr().out
    assert len(CutSet.from_file(out / "cuts_dev.jsonl.gz")) == 1
    assert not (out / "cuts_train.jsonl.gz").exists()
    done = json.loads((out / "COMPLETE.json").read_text())
    assert (done["cuts"], done["dropped"]) == ({"dev": 1}, {"dev": n_dev - join})


def test_rerun_is_a_no_op(corpus, long_corpus, capsys):
    marker = long_corpus / "COMPLETE.json"
    before = {p: p.stat().st_mtime_ns for p in long_corpus.rglob("*")}
    argv = ["--corpus", str(corpus), "--out", str(long_corpus), "--join", str(JOIN)]
    assert recipe.main(argv) == 0
    assert "complete already" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in long_corpus.rglob("*")} == before
    assert marker.exists()


def test_other_settings_over_a_complete_corpus_are_refused(corpus, long_corpus, capsys):
    argv = ["--corpus", str(corpus), "--out", str(long_corpus), "--join", str(JOIN + 1)]
    assert recipe.main(argv) == 2
    assert "pass another --out" in capsys.readouterr().err
