"""The anchor: OpenAI Whisper tiny.en's own zero-shot WER on the learning tables' test sets.

    python -m bench.bench_whisper_anchor [--model data/pretrained/whisper-tiny.en]
        [--sets data/mix/test_sets.yaml] [--normalizer basic whisper_en none]
        [--batch-size 16] [--threads 1] [--limit N] [--json OUT]

The learning tables of docs/performance.md score the models trained here with
``python -m train.evaluate`` (through bench/bench_learning.py) on the corpus-asr test split
(`make corpus-asr`) and the LibriSpeech-layout test-clean (`make librispeech`): the two sets of
data/mix/test_sets.yaml (`make mix` copies it there). This decodes the same utterances with a
real pretrained recognizer, Whisper tiny.en as `make pretrained` converts it, run the way
Whisper is meant to run and never trained here: each utterance padded to 30 s of log-mel by the
folder's WhisperFeatureExtractor, then transformers' ``generate`` (greedy, English, no
timestamps: the folder's generation config), batched, fp32 on CPU. Sets are read, checked,
normalized and scored by train.evaluate's own code (train.data.sources, train.data.source_cuts,
train.eval.normalizers, train.eval.wer: corpus-level rates), so the WER is the row a trained model
has to beat.

The first normalizer named is the headline (its pairs are the examples shown); the default
``basic`` is train.evaluate's default, which the learning tables use. Whisper writes numbers as
digits ("Call 877-8" for "call eight seven seven eight") and punctuates: ``basic`` counts the
digits as errors, ``whisper_en`` turns numbers into digits on both sides. So each set's WER is
also split between the utterances whose hypothesis holds a digit and the rest.

Prints per set: utterances, decoding seconds (audio loading and features included, as in
train.evaluate) and real-time factor, then per normalizer WER, CER and the word substitutions,
deletions and insertions; a few hypothesis/reference pairs, and the utterance with the most
word edits (greedy decoding without Whisper's temperature fallback can loop until its 448-token
limit: one such hypothesis adds ~220 insertions).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from lhotse.cut import Cut
from transformers import WhisperForConditionalGeneration, WhisperTokenizerFast

from recipes.pretrained import DEFAULT_OUT, WHISPER
from train.data.features import AudioLimits, Featurizer, extractor_of
from train.data.source_cuts import check_sources, load_source_cuts, transcript
from train.data.sources import read_sources
from train.eval.normalizers import DEFAULT_NORMALIZER, NORMALIZERS, Normalizer, normalizer
from train.eval.wer import score_corpus, score_pair

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = 4  # hypothesis/reference pairs printed per set
SHOWN = 120  # characters of the worst hypothesis printed


def say(line: str) -> None:
    print(f"bench_whisper_anchor: {line}", file=sys.stderr, flush=True)


def test_sets(path: Path, featurizer: Featurizer, limit: int | None) -> dict[str, list[Cut]]:
    """Each set's usable cuts (checked as train.evaluate checks them), at most ``limit`` of
    each in manifest order, sorted by duration as train.evaluate batches them."""
    if not path.is_file():
        sys.exit(f"error: --sets {path} does not exist; run `make mix` (or name a source file)")
    limits = AudioLimits(featurizer.sampling_rate, float(featurizer.hf.chunk_length))
    sets = {}
    for check in check_sources(read_sources(path, "--sets"), None, limits, say):
        usable = [cut for cut in load_source_cuts(check.source) if cut.id not in check.excluded]
        chosen = usable[:limit] if limit else usable
        sets[check.source.name] = sorted(chosen, key=lambda cut: (cut.duration, cut.id))
    return sets


def transcribe(
    model: WhisperForConditionalGeneration,
    tokenizer: WhisperTokenizerFast,
    featurizer: Featurizer,
    cuts: list[Cut],
    batch_size: int,
    name: str,
) -> list[str]:
    """Whisper's greedy transcript of every cut, in order."""
    hypotheses: list[str] = []
    started = time.perf_counter()
    for start in range(0, len(cuts), batch_size):
        audio = [featurizer.audio(cut) for cut in cuts[start : start + batch_size]]
        features = featurizer.hf(
            audio, sampling_rate=featurizer.sampling_rate, return_tensors="pt"
        ).input_features  # padded to the extractor's 30 s
        with torch.no_grad():
            ids = model.generate(features)
        hypotheses += tokenizer.batch_decode(ids, skip_special_tokens=True)
        elapsed = time.perf_counter() - started
        say(f"{name}: {len(hypotheses)}/{len(cuts)} utterances ({elapsed:.0f} s)")
    return hypotheses


def has_digit(text: str) -> bool:
    return any(char.isdigit() for char in text)


def scores(pairs: list[tuple[str, str]], name: str) -> dict[str, dict]:
    """The figures of ``pairs`` (reference, hypothesis) after normalizer ``name``: all of them,
    those whose raw hypothesis holds a digit, and the rest."""
    normalize = normalizer(name)
    digits = [pair for pair in pairs if has_digit(pair[1])]
    others = [pair for pair in pairs if not has_digit(pair[1])]
    return {
        part: score_corpus(chosen, normalize).figures() if chosen else {}
        for part, chosen in (("all", pairs), ("digit_hypotheses", digits), ("other", others))
    }


def word_edits(row: dict, normalize: Normalizer) -> int:
    counts = score_pair(row["reference"], row["hypothesis"], normalize)
    return counts.word_substitutions + counts.word_deletions + counts.word_insertions


def show_worst(rows: list[dict], normalize: Normalizer, total: int) -> None:
    """The utterance with the most word edits (a repetition loop shows here), raw."""
    worst = max(rows, key=lambda row: word_edits(row, normalize))
    hypothesis = worst["hypothesis"]
    shown = hypothesis[:SHOWN] + ("..." if len(hypothesis) > SHOWN else "")
    print(
        f"    most word edits: {word_edits(worst, normalize)} of the set's {total}, {worst['id']}"
    )
    print(f"    ref {worst['reference']!r}")
    print(f"    hyp {shown!r}")


def percent(figures: dict, key: str) -> str:
    return f"{100 * figures[key]:.1f}%" if figures else "-"


def report(name: str, result: dict, normalizers: list[str]) -> None:
    """A set's figures on stdout."""
    first = result["scores"][normalizers[0]]["all"]
    print(
        f"{name}: {first['num_utterances']} utterances, {result['decode_s']:.1f} s decoding "
        f"(RTF {result['real_time_factor']:.3f}); {result['digit_hypotheses']} hypotheses "
        "hold a digit"
    )
    for norm in normalizers:
        parts = result["scores"][norm]
        every = parts["all"]
        print(
            f"  {norm:10s} WER {percent(every, 'wer'):>6s} CER {percent(every, 'cer'):>6s} "
            f"(S {every['substitutions']}, D {every['deletions']}, I {every['insertions']} of "
            f"{every['reference_words']} words); WER with a digit in the hypothesis "
            f"{percent(parts['digit_hypotheses'], 'wer')}, without {percent(parts['other'], 'wer')}"
        )
    normalize = normalizer(normalizers[0])
    for row in result["rows"][:: max(1, len(result["rows"]) // EXAMPLES)][:EXAMPLES]:
        print(f"    ref {normalize(row['reference'])!r}")
        print(f"    hyp {normalize(row['hypothesis'])!r}  (raw {row['hypothesis']!r})")
    total = first["substitutions"] + first["deletions"] + first["insertions"]
    show_worst(result["rows"], normalize, total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO / DEFAULT_OUT / WHISPER.name)
    parser.add_argument(
        "--sets",
        type=Path,
        default=REPO / "data/mix/test_sets.yaml",
        help="a test-set source file, as train.evaluate's sets=",
    )
    parser.add_argument(
        "--normalizer",
        nargs="+",
        choices=list(NORMALIZERS),
        default=[DEFAULT_NORMALIZER, *(n for n in NORMALIZERS if n != DEFAULT_NORMALIZER)],
        help="normalizers to score after; the first is the headline",
    )
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads")
    parser.add_argument("--limit", type=int, help="score only the first N utterances of each set")
    parser.add_argument("--json", type=Path, help="write figures and hypotheses here")
    args = parser.parse_args()
    if min(args.batch_size, args.threads, args.limit or 1) < 1:
        parser.error("--batch-size, --threads and --limit must be at least 1")

    torch.set_num_threads(args.threads)
    featurizer = Featurizer(extractor_of(str(args.model)))
    sets = test_sets(args.sets.resolve(), featurizer, args.limit)
    model = WhisperForConditionalGeneration.from_pretrained(args.model, dtype=torch.float32).eval()
    tokenizer = WhisperTokenizerFast.from_pretrained(args.model)
    say(f"{args.model.name}, {torch.get_num_threads()} thread(s); sets: {', '.join(sets)}")
    results = {}
    for name, cuts in sets.items():
        started = time.perf_counter()
        hypotheses = transcribe(model, tokenizer, featurizer, cuts, args.batch_size, name)
        decode_s = time.perf_counter() - started
        rows = [
            {"id": cut.id, "reference": transcript(cut), "hypothesis": hypothesis}
            for cut, hypothesis in zip(cuts, hypotheses, strict=True)
        ]
        pairs = [(row["reference"], row["hypothesis"]) for row in rows]
        results[name] = {
            "decode_s": decode_s,
            "real_time_factor": decode_s / sum(cut.duration for cut in cuts),
            "digit_hypotheses": sum(has_digit(hypothesis) for hypothesis in hypotheses),
            "scores": {norm: scores(pairs, norm) for norm in args.normalizer},
            "rows": rows,
        }
        report(name, results[name], args.normalizer)
    if args.json:
        settings = {key: value for key, value in vars(args).items() if key != "json"}
        text = json.dumps({**settings, "results": results}, indent=1, default=str)
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
