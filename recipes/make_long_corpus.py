"""Make a long-utterance corpus by joining consecutive cuts of a corpus from make_corpus.py.

    python recipes/make_long_corpus.py --corpus data/corpus --out data/corpus_long --join 8
        [--splits train dev]

Context parallelism splits the decoder's sequence over ranks, which only pays on long
sequences; the espeak-ng utterances last one to four seconds. Each long cut here is --join
consecutive cuts of one split, in manifest order: their stored fbank matrices concatenated
along time, their transcripts joined with a space, and a duration of num_frames x frame shift
(10 ms, the source features'), which is the sum of the source cuts' feature durations, so that
lhotse loads exactly the concatenated frames. Cuts at the end of a split that do not fill a
group of --join are dropped; how many is printed and recorded in COMPLETE.json. A split with
fewer than --join cuts is refused.

The source corpus must be complete (its COMPLETE.json is present) and is only read.

Layout of --out (paths inside manifests are relative to it, so the corpus can be moved):
    feats/                    float32 fbank features, one .npy per long cut (NumpyFilesWriter)
    cuts_<split>.jsonl.gz     one per --splits; feature-only cuts (no recording:
    train/data/loader.py
                              reads features and transcripts only), each listing its source
                              cut ids in custom["source_cuts"]
    COMPLETE.json             written last, with the settings; its presence is the only sign of
                              a finished corpus

There are no wavs, recording manifests or Lhotse Shar shards: the long corpus is read from its
jsonl manifests (data.shar=false, the default).

The corpus is built in a temporary sibling directory and renamed into place, so an
interrupted run never leaves output that looks complete; a rerun over a complete corpus
made with the same settings does nothing.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from lhotse import CutSet, MonoCut, NumpyFilesWriter, SupervisionSegment
from lhotse.cut import Cut
from lhotse.utils import fastcopy

from orchestrator.errors import UsageError
from recipes.corpus_dir import MARKER, build_whole, completed
from train.data.loader import load_cuts

PROGRESS_EVERY = 16  # long cuts between progress lines


def manifest(root: Path, split: str) -> Path:
    return root / f"cuts_{split}.jsonl.gz"


def describe(counts: dict[str, int]) -> str:
    """``{"train": 65, "dev": 9}`` as ``65 train + 9 dev``."""
    return " + ".join(f"{n} {split}" for split, n in counts.items())


def read_source_settings(corpus: Path) -> dict:
    """The settings of a complete source corpus; refuses a missing or unfinished one."""
    marker = corpus / MARKER
    if not marker.exists():
        what = "does not exist" if not corpus.exists() else f"has no {MARKER} (unfinished)"
        raise UsageError(
            f"source corpus {corpus} {what}: make it with "
            f"`python recipes/make_corpus.py --out {corpus}` (or `make corpus`)"
        )
    return json.loads(marker.read_text())["settings"]


def read_split(corpus: Path, split: str, join: int) -> list[Cut]:
    """One split's cuts in manifest order, checked to be joinable (features of one kind)."""
    path = manifest(corpus, split)
    if not path.exists():
        raise UsageError(f"source corpus {corpus} has no split {split!r}: {path.name} is missing")
    cuts = list(load_cuts(path))
    if len(cuts) < join:
        raise UsageError(
            f"split {split!r} of {corpus} has {len(cuts)} cuts, fewer than --join {join}"
        )
    without = [c.id for c in cuts if not c.has_features]
    if without:
        raise UsageError(f"cut {without[0]} of {path} has no features; remake the source corpus")
    kinds = {
        (c.features.type, c.features.frame_shift, c.features.num_features, c.sampling_rate)
        for c in cuts
    }
    if len(kinds) != 1:
        raise UsageError(
            f"the cuts of {path} have features of {len(kinds)} kinds "
            f"(type, frame shift, bins, sampling rate): {sorted(kinds)}; they cannot be joined"
        )
    return cuts


def join_cuts(cut_id: str, group: list[Cut], writer: NumpyFilesWriter) -> MonoCut:
    """One feature-only cut holding ``group``'s features and transcripts back to back."""
    feats = np.concatenate([c.load_features() for c in group], axis=0)
    key = writer.write(cut_id, feats)
    frame_shift = group[0].features.frame_shift
    duration = round(feats.shape[0] * frame_shift, 6)
    features = fastcopy(
        group[0].features,
        num_frames=feats.shape[0],
        start=0.0,
        duration=duration,
        storage_path="feats",  # relative to the corpus, like make_corpus's
        storage_key=key,
        recording_id=None,
    )
    text = " ".join(s.text for c in group for s in c.supervisions)
    supervision = SupervisionSegment(
        id=cut_id,
        recording_id=cut_id,
        start=0.0,
        duration=duration,
        channel=0,
        text=text,
        language=group[0].supervisions[0].language,
    )
    return MonoCut(
        id=cut_id,
        start=0.0,
        duration=duration,
        channel=0,
        features=features,
        supervisions=[supervision],
        custom={"source_cuts": [c.id for c in group]},
    )


def build_corpus(root: Path, sources: dict[str, list[Cut]], join: int) -> dict:
    """Write the long corpus into ``root`` (a fresh directory); returns the marker's content."""
    start = time.monotonic()
    counts, dropped, hours, max_duration = {}, {}, 0.0, 0.0
    with NumpyFilesWriter(root / "feats") as writer:
        for split, cuts in sources.items():
            groups = len(cuts) // join
            long_cuts = []
            for g in range(groups):
                group = cuts[g * join : (g + 1) * join]
                long_cuts.append(join_cuts(f"long-{split}-{g:05d}", group, writer))
                if (g + 1) % PROGRESS_EVERY == 0 or g + 1 == groups:
                    elapsed = time.monotonic() - start
                    print(
                        f"make_long_corpus: {split} {g + 1}/{groups} long cuts ({elapsed:.1f} s)",
                        flush=True,
                    )
            CutSet.from_cuts(long_cuts).to_file(manifest(root, split))
            counts[split] = groups
            dropped[split] = len(cuts) - groups * join
            durations = [c.duration for c in long_cuts]
            hours += sum(durations) / 3600
            max_duration = max(max_duration, *durations)
            print(
                f"make_long_corpus: {split}: {groups} long cuts of {join} from {len(cuts)} cuts, "
                f"mean {sum(durations) / groups:.1f} s, max {max(durations):.1f} s; "
                f"{dropped[split]} left over cut(s) dropped",
                flush=True,
            )
    return {
        "cuts": counts,
        "dropped": dropped,
        "hours": round(hours, 4),
        "max_duration": round(max_duration, 2),
        "build_seconds": round(time.monotonic() - start, 1),
    }


def make_long_corpus(corpus: Path, out: Path, join: int, splits: list[str]) -> dict:
    """Build the long corpus at ``out`` unless a complete one with these settings is there."""
    if out == corpus:
        raise UsageError(f"--out {out} is the source corpus: pass another --out")
    settings = {
        "corpus": str(corpus),
        "corpus_settings": read_source_settings(corpus),
        "join": join,
        "splits": splits,
    }
    done = completed(out, settings)
    if done is not None:
        cuts = describe(done["cuts"])
        print(f"make_long_corpus: {out} is complete already ({cuts} cuts)", flush=True)
        return done
    sources = {split: read_split(corpus, split, join) for split in splits}
    summary, built_here = build_whole(
        out, settings, lambda tmp: build_corpus(tmp, sources, join), "make_long_corpus"
    )
    if built_here:
        print(
            f"make_long_corpus: wrote {describe(summary['cuts'])} long cuts "
            f"({summary['hours'] * 60:.1f} min) to {out} in {summary['build_seconds']} s",
            flush=True,
        )
    return summary


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, required=True, help="complete source corpus")
    parser.add_argument("--out", type=Path, required=True, help="corpus directory to create")
    parser.add_argument("--join", type=int, default=8, help="consecutive cuts per long cut")
    parser.add_argument(
        "--splits", nargs="+", default=["train", "dev"], help="splits to join (cuts_<split>)"
    )
    args = parser.parse_args(argv)
    if args.join < 1:
        parser.error("--join must be positive")
    if len(set(args.splits)) != len(args.splits):
        parser.error("--splits names a split twice")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        make_long_corpus(args.corpus.resolve(), args.out.resolve(), args.join, args.splits)
    except UsageError as err:
        print(f"make_long_corpus: error: {err}", file=sys.stderr)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
