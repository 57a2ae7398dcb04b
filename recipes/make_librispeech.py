"""Make a tiny corpus in LibriSpeech's own layout and prepare it with lhotse's own recipe.

    python -m recipes.make_librispeech --out data/librispeech [--utterances 2000] [--seed 0]
        [--jobs J]

A real third-party format to test "your own data" against: the audio is spoken by espeak-ng
as in the project's corpus (recipes/make_corpus.py: its sentences, voices and tools), but laid
out as LibriSpeech ships it, and the manifests come from ``lhotse prepare librispeech``, not
from us. Layout of --out:

    LibriSpeech/<part>/<speaker>/<chapter>/<speaker>-<chapter>-<utt:04d>.flac   16 kHz mono
    LibriSpeech/<part>/<speaker>/<chapter>/<speaker>-<chapter>.trans.txt        "ID TRANSCRIPT"
    manifests/librispeech_{recordings,supervisions}_<part>.jsonl.gz             lhotse's own

Parts: train-clean-100 (4 speakers), dev-clean and test-clean (2 speakers each), 2 chapters per
speaker; speaker and chapter ids are unique across the corpus, as in LibriSpeech. dev-clean and
test-clean each get a tenth of --utterances (at least 4), train-clean-100 the rest. Each speaker
is one espeak-ng voice; each utterance has its own speed. Transcripts are uppercase without
punctuation, as LibriSpeech's are; manifests' audio paths are absolute.

Sentences come from the project corpus's generator and vocabulary, drawn from another random
stream, so a model can train on both corpora. test-clean speaks only the sentences that the
project corpus holds out for its test split (``is_test_text``), train-clean-100 and dev-clean
only the others, so no test sentence of either corpus is in either's training data.

The audio is synthesized in a temporary sibling of --out and renamed into place; lhotse then
writes its manifests into ``manifests.partial``, renamed to ``manifests`` once every utterance
is found in them. An interrupted run removes what it wrote; a killed one leaves no
``manifests/``, the sign of a finished corpus. An existing non-empty --out is refused.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from lhotse import SupervisionSet

from orchestrator.errors import UsageError
from recipes.make_corpus import (
    CHUNK_SIZE,
    SPEEDS,
    VOICES,
    Utterance,
    check_tools,
    is_test_text,
    make_text,
    run_tool,
    synthesize,
)

PARTS = {"train-clean-100": 4, "dev-clean": 2, "test-clean": 2}  # part: number of speakers
HELD_OUT_PART = "test-clean"  # speaks the project corpus's held-out test sentences
CHAPTERS_PER_SPEAKER = 2
EVAL_SHARE = 10  # dev-clean and test-clean each get 1/EVAL_SHARE of the utterances ...
MIN_EVAL_UTTERANCES = 4  # ... but at least this many, one per chapter
MIN_UTTERANCES = 2 * MIN_EVAL_UTTERANCES + PARTS["train-clean-100"] * CHAPTERS_PER_SPEAKER
DEFAULT_UTTERANCES = 2000  # 1600 train-clean-100, 200 dev-clean, 200 test-clean
CORPUS_DIR = "LibriSpeech"
MANIFESTS_DIR = "manifests"
LHOTSE = Path(sys.executable).parent / "lhotse"  # lhotse's console script, beside our python


def manifest_path(manifests: Path, kind: str, part: str) -> Path:
    """Where ``lhotse prepare librispeech`` writes a part's ``recordings`` or ``supervisions``."""
    return manifests / f"librispeech_{kind}_{part}.jsonl.gz"


def part_sizes(utterances: int) -> dict[str, int]:
    """Utterances per part: a tenth each for dev-clean and test-clean, the rest for train."""
    held = max(MIN_EVAL_UTTERANCES, round(utterances / EVAL_SHARE))
    return {"train-clean-100": utterances - 2 * held, "dev-clean": held, "test-clean": held}


def draw_text(rng: random.Random, held_out: bool) -> str:
    """A sentence of the project corpus, on the given side of its test hold-out."""
    while True:
        text = make_text(rng)
        if is_test_text(text) == held_out:
            return text


def plan_librispeech(utterances: int, seed: int) -> dict[str, list[Utterance]]:
    """Every part's utterances (ids ``speaker-chapter-NNNN``, lowercase text as spoken) as a
    deterministic function of (utterances, seed)."""
    # A string seed gives a stream other than make_corpus's random.Random(seed), in any process.
    rng = random.Random(f"librispeech-{seed}")
    num_speakers = sum(PARTS.values())
    speaker_ids = iter(rng.sample(range(100, 10000), num_speakers))
    chapter_ids = iter(rng.sample(range(10000, 200000), num_speakers * CHAPTERS_PER_SPEAKER))
    voices = itertools.cycle(VOICES)
    plan: dict[str, list[Utterance]] = {}
    for part, size in part_sizes(utterances).items():
        chapters = []
        for _ in range(PARTS[part]):
            speaker, voice = next(speaker_ids), next(voices)
            chapters += [(speaker, next(chapter_ids), voice) for _ in range(CHAPTERS_PER_SPEAKER)]
        plan[part] = [
            Utterance(
                utt_id=f"{speaker}-{chapter}-{i:04d}",
                text=draw_text(rng, held_out=part == HELD_OUT_PART),
                voice=voice,
                speed=rng.randint(*SPEEDS),
            )
            for k, (speaker, chapter, voice) in enumerate(chapters)
            for i in range(size // len(chapters) + (k < size % len(chapters)))
        ]
    return plan


def chapter_dir(corpus: Path, part: str, utt_id: str) -> Path:
    """``corpus/part/speaker/chapter``, the folder LibriSpeech keeps an utterance in."""
    speaker, chapter, _ = utt_id.split("-")
    return corpus / part / speaker / chapter


def check_flac() -> None:
    """sox writes FLAC only with its format library; name the package when it is missing."""
    help_text = subprocess.run(["sox", "-h"], capture_output=True, text=True).stdout
    formats = next(
        (
            line.split(":", 1)[1].split()
            for line in help_text.splitlines()
            if "FILE FORMATS" in line
        ),
        [],
    )
    if "flac" not in formats:
        raise UsageError(
            "sox cannot write FLAC: install Debian's libsox-fmt-base "
            "(apt-get install libsox-fmt-base) and try again"
        )


def refuse_existing(out: Path) -> None:
    """Never mix a new corpus into a finished one, an unfinished one or a user's files."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out} exists and is not empty: delete it or pick another --out")


def write_transcripts(corpus: Path, plan: dict[str, list[Utterance]]) -> None:
    """One ``speaker-chapter.trans.txt`` per chapter, uppercase, as LibriSpeech has them."""
    for part, utterances in plan.items():
        for folder, chapter in itertools.groupby(
            utterances, key=lambda u: chapter_dir(corpus, part, u.utt_id)
        ):
            folder.mkdir(parents=True)
            lines = "".join(f"{u.utt_id} {u.text.upper()}\n" for u in chapter)
            (folder / f"{folder.parent.name}-{folder.name}.trans.txt").write_text(lines)


def synthesize_chunk(chunk: list[tuple[Utterance, Path]]) -> int:
    """Speak a chunk of utterances into their FLAC files (sox writes FLAC by the file name);
    runs in a pool worker."""
    for utt, flac in chunk:
        synthesize(utt, flac)
    return len(chunk)


def write_audio(corpus: Path, plan: dict[str, list[Utterance]], jobs: int) -> None:
    """Synthesize every utterance on ``jobs`` processes, printing progress per chunk."""
    start = time.monotonic()
    todo = [
        (utt, chapter_dir(corpus, part, utt.utt_id) / f"{utt.utt_id}.flac")
        for part, utterances in plan.items()
        for utt in utterances
    ]
    chunks = [todo[i : i + CHUNK_SIZE] for i in range(0, len(todo), CHUNK_SIZE)]
    done = 0
    pool = ProcessPoolExecutor(max_workers=jobs)
    try:
        for future in as_completed([pool.submit(synthesize_chunk, c) for c in chunks]):
            done += future.result()
            elapsed = time.monotonic() - start
            print(f"make_librispeech: {done}/{len(todo)} utterances ({elapsed:.1f} s)", flush=True)
    finally:
        pool.shutdown(cancel_futures=True)  # an interrupted run stops after the chunks under way


def prepare_manifests(out: Path, plan: dict[str, list[Utterance]], jobs: int) -> dict[str, float]:
    """Run ``lhotse prepare librispeech`` on the corpus at its final, absolute path, check that
    it found every utterance (it drops one whose FLAC it cannot find with a mere warning), then
    publish its manifests. Returns the seconds of audio per part."""
    staging = out / f"{MANIFESTS_DIR}.partial"
    print("make_librispeech: running lhotse prepare librispeech", flush=True)
    parts = [arg for part in plan for arg in ("-p", part)]
    corpus = out / CORPUS_DIR
    run_tool(
        [str(LHOTSE), "prepare", "librispeech", *parts, "-j", str(jobs), str(corpus), str(staging)]
    )
    seconds = {}
    for part, utterances in plan.items():
        supervisions = SupervisionSet.from_file(manifest_path(staging, "supervisions", part))
        if sorted(supervisions.ids) != sorted(u.utt_id for u in utterances):
            raise RuntimeError(
                f"lhotse prepared {len(supervisions)} of the {len(utterances)} utterances "
                f"of {corpus / part}"
            )
        seconds[part] = sum(s.duration for s in supervisions)
    staging.rename(out / MANIFESTS_DIR)
    return seconds


def make_librispeech(out: Path, utterances: int, seed: int, jobs: int) -> dict[str, float]:
    """Build the corpus and its lhotse manifests at ``out`` (absolute); returns the seconds of
    audio per part."""
    refuse_existing(out)
    check_tools()
    check_flac()
    plan = plan_librispeech(utterances, seed)
    sizes = ", ".join(f"{len(utts)} {part}" for part, utts in plan.items())
    print(f"make_librispeech: {utterances} utterances planned ({sizes})", flush=True)
    start = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f"{out.name}.partial-", dir=out.parent))
    building.chmod(0o755)  # mkdtemp makes it private; the corpus is meant to be shared
    try:
        write_transcripts(building / CORPUS_DIR, plan)
        write_audio(building / CORPUS_DIR, plan, jobs)
        building.rename(out)
        building = out  # the audio is at its final path, which lhotse writes into its manifests
        seconds = prepare_manifests(out, plan, jobs)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    print(
        f"make_librispeech: wrote {sizes} utterances ({sum(seconds.values()) / 60:.1f} min) "
        f"to {out} in {time.monotonic() - start:.1f} s",
        flush=True,
    )
    print(
        f"make_librispeech: lhotse manifests: {out / MANIFESTS_DIR}/"
        f"librispeech_{{recordings,supervisions}}_{{{','.join(plan)}}}.jsonl.gz",
        flush=True,
    )
    return seconds


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to create")
    parser.add_argument(
        "--utterances",
        type=int,
        default=DEFAULT_UTTERANCES,
        help="utterances in all three parts together",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the sentence plan")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="synthesis processes")
    args = parser.parse_args(argv)
    if args.utterances < MIN_UTTERANCES:
        parser.error(f"--utterances must be at least {MIN_UTTERANCES} (one per chapter)")
    if args.jobs < 1:
        parser.error("--jobs must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        make_librispeech(args.out.resolve(), args.utterances, args.seed, args.jobs)
    except UsageError as err:
        print(f"make_librispeech: error: {err}", file=sys.stderr)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
