"""Make a small synthetic English speech corpus with espeak-ng, ready for lhotse training.

    python recipes/make_corpus.py --out data/corpus --num 600 [--jobs 2] [--seed 0] [--tones]

Each utterance is a short sentence (numbers, words, small phrases) drawn deterministically
from --seed, spoken by one of a few espeak-ng voices at a varied speed, resampled to 16 kHz
with sox (``--tones``: a tone per character instead, for machines without espeak-ng, such as
the GPU check's). Fbank features (80 bins) are computed once here, because computing them per step
would cost more than the tiny models that train on them.

Three splits, decided from the plan before anything is synthesized:
    test    held-out sentences: a sentence goes to test when a keyed BLAKE2b hash of its text
            falls in the lowest TEST_FRACTION (about 10%) of the hash range, and so does every
            utterance of it; no test text occurs in train or dev, in any corpus (--num, --seed)
    dev     every 8th of the other utterances; it may share texts with train
    train   the rest
A --num and --seed that leave a split empty are refused (small corpora may hold no test
sentence).

Layout of --out (paths inside manifests are relative to it, so the corpus can be moved):
    wavs/utt-NNNNN.wav        16 kHz mono audio
    feats/                    float32 fbank features, one .npy per cut (lhotse NumpyFilesWriter;
                              lilcom and h5py, which the compressed writers need, are not installed)
    recordings.jsonl.gz, supervisions.jsonl.gz
    cuts_train.jsonl.gz, cuts_dev.jsonl.gz, cuts_test.jsonl.gz
    shar/train/               Lhotse Shar shards (cuts, recording, features) for streaming
    COMPLETE.json             written last; its presence is the only sign of a finished corpus

The corpus is built in a temporary sibling directory and renamed into place, so an
interrupted run never leaves output that looks complete; a rerun over a complete corpus
made with the same settings does nothing. A corpus made before the test split existed (its
settings have no test_fraction) is refused with an error that says to delete it, rather than
deleted here: a training run may still be reading it.
"""

import argparse
import hashlib
import json
import math
import random
import shutil
import subprocess
import sys
import time
import wave
from array import array
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import torch
from lhotse import (
    CutSet,
    Fbank,
    FbankConfig,
    MonoCut,
    NumpyFilesWriter,
    Recording,
    RecordingSet,
    SupervisionSegment,
    SupervisionSet,
)
from lhotse.utils import fastcopy

from orchestrator.errors import UsageError
from recipes.corpus_dir import MARKER, build_whole, completed

SAMPLE_RATE = 16000
NUM_MEL_BINS = 80
CHUNK_SIZE = 25  # utterances per pool task; progress is reported per finished chunk
SPLITS = ("train", "dev", "test")
DEV_EVERY = 8  # every 8th utterance not held out for test goes to the dev split
TEST_FRACTION = 0.1  # share of the hash range whose sentences are held out for test
# Keys the test-split hash: changing it moves sentences between splits in every corpus.
TEST_HASH_KEY = b"test-split"
VOICES = ("en-us", "en", "en+f3", "en+m3", "en-gb-x-rp", "en-us+f2")
SPEEDS = (130, 190)
REQUIRED_TOOLS = ("espeak-ng", "sox")


def words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


ONES = words(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen"
)
TENS = words("_ _ twenty thirty forty fifty sixty seventy eighty ninety")
ADJECTIVES = words("red green blue small large quiet bright cold warm quick slow happy old new")
NOUNS = words("cat boat tree lamp bird cup house river train window garden letter road stone")
VERBS = words("runs sleeps waits sings falls turns shines moves stops grows")
PLACES = ("the station", "the market", "the park", "the bridge", "the corner", "the school")


@dataclass(frozen=True)
class Utterance:
    """What one utterance says and how it is spoken."""

    utt_id: str
    text: str
    voice: str
    speed: int


def number_words(n: int) -> str:
    """Spell 0..999 in English words."""
    if n < 20:
        return ONES[n]
    if n < 100:
        tens, ones = divmod(n, 10)
        return TENS[tens] + ("" if ones == 0 else f" {ONES[ones]}")
    hundreds, rest = divmod(n, 100)
    head = f"{ONES[hundreds]} hundred"
    return head if rest == 0 else f"{head} and {number_words(rest)}"


def make_text(rng: random.Random) -> str:
    """One short sentence: a number, a digit string, a phrase or a few words."""
    kind = rng.randrange(5)
    if kind == 0:
        return number_words(rng.randrange(1000))
    if kind == 1:
        return "call " + " ".join(ONES[rng.randrange(10)] for _ in range(4))
    if kind == 2:
        return f"the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} {rng.choice(VERBS)}"
    if kind == 3:
        count = number_words(rng.randrange(2, 100))
        return f"{count} {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}s near {rng.choice(PLACES)}"
    vocabulary = ADJECTIVES + NOUNS + VERBS
    return " ".join(rng.choice(vocabulary) for _ in range(rng.randrange(2, 5)))


def plan_utterances(num: int, seed: int) -> list[Utterance]:
    """The whole corpus as a deterministic function of (num, seed)."""
    rng = random.Random(seed)
    return [
        Utterance(
            utt_id=f"utt-{i:05d}",
            text=make_text(rng),
            voice=rng.choice(VOICES),
            speed=rng.randint(*SPEEDS),
        )
        for i in range(num)
    ]


def is_test_text(text: str) -> bool:
    """Whether ``text`` is held out for the test split. Decided by the text alone, with a hash
    that is the same in every process (Python's ``hash()`` of a str is salted per process), so
    every utterance of a sentence is on the same side in any corpus."""
    digest = hashlib.blake2b(text.encode(), digest_size=8, person=TEST_HASH_KEY).digest()
    return int.from_bytes(digest, "big") < TEST_FRACTION * 2**64


def assign_splits(utterances: list[Utterance]) -> dict[str, str]:
    """Each utterance's split: test for held-out texts, then every 8th of the others dev."""
    splits = {}
    kept = 0
    for utt in utterances:
        if is_test_text(utt.text):
            splits[utt.utt_id] = "test"
            continue
        splits[utt.utt_id] = "dev" if kept % DEV_EVERY == DEV_EVERY - 1 else "train"
        kept += 1
    return splits


def check_splits(splits: dict[str, str], num: int, seed: int) -> None:
    """Refuse a plan with an empty split before anything is synthesized."""
    empty = [split for split in SPLITS if split not in splits.values()]
    if empty:
        raise UsageError(
            f"--num {num} --seed {seed} puts no utterance in {' or '.join(empty)} "
            f"(about {TEST_FRACTION:.0%} of the sentences are held out for test, and every "
            f"{DEV_EVERY}th other utterance goes to dev): pass a larger --num"
        )


def refuse_corpus_without_test_split(out: Path) -> None:
    """A corpus made before the test split has a COMPLETE.json too: name why it is refused."""
    marker = out / MARKER
    if marker.exists() and "test_fraction" not in json.loads(marker.read_text())["settings"]:
        raise UsageError(
            f"{out} was made by an earlier make_corpus and has no test split "
            f"(cuts_test.jsonl.gz): delete {out} and run again"
        )


def describe(counts: Mapping[str, int]) -> str:
    """Split sizes (from a summary or a count of splits), e.g. ``470 train, 65 dev, 65 test``."""
    return ", ".join(f"{counts[split]} {split}" for split in SPLITS)


def check_tools() -> None:
    """Fail early, with the fix, when the speech tools are not installed."""
    missing = [tool for tool in REQUIRED_TOOLS if shutil.which(tool) is None]
    if missing:
        raise UsageError(
            f"{' and '.join(missing)} not found on PATH: run make setup-system "
            f"(installs espeak-ng and sox) and try again"
        )


def run_tool(cmd: list[str]) -> None:
    """Run espeak-ng or sox; on failure, say which tool failed and what it printed."""
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {result.returncode}: {result.stderr.strip()}")


def tone_speech(text: str, speed: int) -> array:
    """16-bit samples that "speak" ``text`` with a tone per character (frequency by character,
    length by speed, a short fade each): learnable audio for machines without espeak-ng."""
    step = SAMPLE_RATE * 12 // speed  # samples per character: ~60-90 ms
    fade = step // 8
    samples = array("h")
    for char in text:
        freq = 150.0 + 40.0 * (ord(char) % 48)
        for i in range(step):
            edge = min(1.0, i / fade, (step - 1 - i) / fade)
            samples.append(int(9000 * edge * math.sin(2 * math.pi * freq * i / SAMPLE_RATE)))
    return samples


def write_tones(utt: Utterance, wav_path: Path) -> None:
    with wave.open(str(wav_path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(SAMPLE_RATE)
        out.writeframes(tone_speech(utt.text, utt.speed).tobytes())


def synthesize(utt: Utterance, wav_path: Path) -> None:
    """Speak one utterance with espeak-ng (22.05 kHz) and resample it to 16 kHz mono with sox."""
    raw = wav_path.with_suffix(".raw.wav")
    run_tool(["espeak-ng", "-v", utt.voice, "-s", str(utt.speed), "-w", str(raw), utt.text])
    run_tool(["sox", str(raw), "-r", str(SAMPLE_RATE), "-c", "1", "-b", "16", str(wav_path)])
    raw.unlink()


def build_chunk(root: Path, utterances: list[Utterance], tones: bool = False) -> list[dict]:
    """Synthesize a chunk of utterances (espeak-ng, or ``tones``) and store their fbank
    features; returns cut dicts.

    Runs in a pool worker. The returned cuts point at their audio and features through
    paths relative to ``root``.
    """
    torch.set_num_threads(1)
    extractor = Fbank(FbankConfig(num_filters=NUM_MEL_BINS))
    cuts = []
    with NumpyFilesWriter(root / "feats") as writer:
        for utt in utterances:
            wav_rel = Path("wavs") / f"{utt.utt_id}.wav"
            (write_tones if tones else synthesize)(utt, root / wav_rel)
            recording = Recording.from_file(root / wav_rel, recording_id=utt.utt_id)
            supervision = SupervisionSegment(
                id=utt.utt_id,
                recording_id=utt.utt_id,
                start=0.0,
                duration=recording.duration,
                channel=0,
                text=utt.text,
                language="en",
                speaker=utt.voice,
            )
            cut = MonoCut(
                id=utt.utt_id,
                start=0.0,
                duration=recording.duration,
                channel=0,
                recording=recording,
                supervisions=[supervision],
            ).compute_and_store_features(extractor, writer)
            source = fastcopy(recording.sources[0], source=str(wav_rel))
            cut = fastcopy(
                cut,
                recording=fastcopy(recording, sources=[source]),
                features=fastcopy(cut.features, storage_path="feats"),
            )
            cuts.append(cut.to_dict())
    return cuts


def build_corpus(
    root: Path,
    utterances: list[Utterance],
    splits: dict[str, str],
    jobs: int,
    shard_size: int,
    tones: bool = False,
) -> dict:
    """Write the whole corpus into ``root`` (a fresh directory), each cut into the manifest of
    its split in ``splits``; returns the marker's content."""
    start = time.monotonic()
    (root / "wavs").mkdir()
    chunks = [utterances[i : i + CHUNK_SIZE] for i in range(0, len(utterances), CHUNK_SIZE)]
    cut_dicts: list[dict] = []
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(build_chunk, root, chunk, tones) for chunk in chunks]
        for future in as_completed(futures):
            cut_dicts.extend(future.result())
            elapsed = time.monotonic() - start
            print(
                f"make_corpus: {len(cut_dicts)}/{len(utterances)} utterances ({elapsed:.1f} s)",
                flush=True,
            )
    cuts = CutSet.from_dicts(sorted(cut_dicts, key=lambda d: d["id"])).to_eager()
    RecordingSet.from_recordings(c.recording for c in cuts).to_file(root / "recordings.jsonl.gz")
    SupervisionSet.from_segments(s for c in cuts for s in c.supervisions).to_file(
        root / "supervisions.jsonl.gz"
    )
    by_split = {
        split: CutSet.from_cuts(c for c in cuts if splits[c.id] == split) for split in SPLITS
    }
    for split, split_cuts in by_split.items():
        split_cuts.to_file(root / f"cuts_{split}.jsonl.gz")
    print("make_corpus: writing Lhotse Shar shards", flush=True)
    shar_dir = root / "shar" / "train"
    shar_dir.mkdir(parents=True)
    train = by_split["train"]
    absolute = train.with_recording_path_prefix(root).with_features_path_prefix(root)
    absolute.to_shar(
        shar_dir,
        fields={"recording": "wav", "features": "numpy"},
        shard_size=shard_size,
    )
    return {
        "num": len(cuts),
        **{split: len(split_cuts) for split, split_cuts in by_split.items()},
        "hours": round(sum(c.duration for c in cuts) / 3600, 4),
        "build_seconds": round(time.monotonic() - start, 1),
    }


def make_corpus(
    out: Path, num: int, seed: int, jobs: int, shard_size: int, tones: bool = False
) -> dict:
    """Build the corpus at ``out`` unless a complete one with these settings is already there."""
    settings = {"num": num, "seed": seed, "shard_size": shard_size, "test_fraction": TEST_FRACTION}
    if tones:
        settings["tones"] = True
    refuse_corpus_without_test_split(out)
    done = completed(out, settings)
    if done is not None:
        print(
            f"make_corpus: {out} is complete already ({done['num']} utterances: {describe(done)})",
            flush=True,
        )
        return done
    utterances = plan_utterances(num, seed)
    splits = assign_splits(utterances)
    check_splits(splits, num, seed)
    if not tones:
        check_tools()
    print(
        f"make_corpus: {len(utterances)} utterances planned ({describe(Counter(splits.values()))})",
        flush=True,
    )
    summary, built_here = build_whole(
        out,
        settings,
        lambda tmp: build_corpus(tmp, utterances, splits, jobs, shard_size, tones),
        "make_corpus",
    )
    if built_here:
        print(
            f"make_corpus: wrote {summary['num']} utterances ({describe(summary)}, "
            f"{summary['hours'] * 60:.1f} min) to {out} in {summary['build_seconds']} s",
            flush=True,
        )
    return summary


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="corpus directory to create")
    parser.add_argument("--num", type=int, default=600, help="number of utterances")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sentence plan")
    parser.add_argument("--shard-size", type=int, default=64, help="cuts per Shar shard")
    parser.add_argument(
        "--tones",
        action="store_true",
        help="a tone per character instead of espeak-ng voices (no espeak-ng or sox needed)",
    )
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.shard_size < 1:
        parser.error("--jobs and --shard-size must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        make_corpus(args.out.resolve(), args.num, args.seed, args.jobs, args.shard_size, args.tones)
    except UsageError as err:
        print(f"make_corpus: error: {err}", file=sys.stderr)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
