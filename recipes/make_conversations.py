"""Spoken conversations and text instructions from the ASR corpus (`make corpus-asr`), for a
speech LLM trained as NeMo's SALM is: speech, conversations about it and text, mixed
(recipes/conf/conversations_whisper.yaml, recipes/conf/salm_speech_chat.yaml; docs/training.md,
"Conversations and text").

    python -m recipes.make_conversations --corpus data/corpus_asr --out data/conversations

For each utterance of a split, a conversation in NeMo's ``multimodal_conversation`` JSON lines:
the user asks a question about the audio (its first word, its last word, or how many words it
has) and the assistant answers, a function of what is said; in the train split a second question
follows as a text turn. Text instructions are sums of two numbers below 50 ("What is 12 plus
7?" -> "19"), as ``text_pairs`` files. For a pretrained LLM (SmolLM2-135M-Instruct), whose
arithmetic is weak, the text task is one it already answers: capitals ("What is the capital of
France? Answer with one word." -> "The capital of France is Paris.", the sentence the base model
itself replies with), half of ``CAPITALS`` to train on and validate with, the other half held out
for the test. The source
files name their data relative to themselves:

- ``input_cfg.yaml``: ASR 0.6, conversations 0.25, sums 0.15 (train splits);
- ``eval_sets.yaml`` (validation in the loop) and ``test_sets.yaml`` (``train.evaluate``): each
  split's ASR, conversations and sums as sets of their own;
- ``speech_chat_*.yaml``: the same with capitals instead of sums (``SPEECH_CHAT``), and
  ``speech_chat_no_text_input_cfg.yaml`` without text, the run that shows what the text keeps.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

from lhotse import CutSet

QUESTIONS = {
    "What is the first word?": lambda words: words[0],
    "What is the last word?": lambda words: words[-1],
    "How many words are said?": lambda words: str(len(words)),
}
SUMS = {"train": 3000, "dev": 200, "test": 400}
WEIGHTS = {"asr": 0.6, "spoken": 0.25, "sums": 0.15}
# Well-known capitals: SmolLM2-135M-Instruct replies with CAPITAL_ANSWER exactly (after the basic
# normalizer) for 38 of these 48 (fp32, greedy; docs/performance.md). Even positions train and
# validate, odd ones are the held-out test.
CAPITALS = (
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Japan", "Tokyo"), ("Russia", "Moscow"), ("Egypt", "Cairo"), ("England", "London"),
    ("China", "Beijing"), ("Greece", "Athens"), ("Canada", "Ottawa"), ("Austria", "Vienna"),
    ("Portugal", "Lisbon"), ("Ireland", "Dublin"), ("Norway", "Oslo"), ("Poland", "Warsaw"),
    ("Sweden", "Stockholm"), ("Denmark", "Copenhagen"), ("Finland", "Helsinki"),
    ("Hungary", "Budapest"), ("Belgium", "Brussels"), ("Cuba", "Havana"), ("Peru", "Lima"),
    ("Kenya", "Nairobi"), ("Thailand", "Bangkok"), ("Iran", "Tehran"), ("Iraq", "Baghdad"),
    ("Argentina", "Buenos Aires"), ("Mexico", "Mexico City"), ("India", "New Delhi"),
    ("Chile", "Santiago"), ("Colombia", "Bogota"), ("Turkey", "Ankara"), ("Ukraine", "Kyiv"),
    ("Romania", "Bucharest"), ("Scotland", "Edinburgh"), ("Wales", "Cardiff"),
    ("Lebanon", "Beirut"), ("Syria", "Damascus"), ("Afghanistan", "Kabul"),
    ("Vietnam", "Hanoi"), ("Indonesia", "Jakarta"), ("Philippines", "Manila"),
    ("Ethiopia", "Addis Ababa"), ("Venezuela", "Caracas"), ("Iceland", "Reykjavik"),
    ("Netherlands", "Amsterdam"), ("Switzerland", "Bern"),
)  # fmt: skip
CAPITAL_QUESTION = "What is the capital of {country}? Answer with one word."
CAPITAL_ANSWER = "The capital of {country} is {city}."
# The speech chat's mixture (recipes/conf/salm_speech_chat.yaml), and the same without its text.
SPEECH_CHAT = {"asr": 0.6, "spoken": 0.25, "capitals": 0.15}


def conversation(cut, audio: str, index: int, follow_up: bool) -> dict:
    """One conversation about ``cut``'s utterance, its questions chosen by ``index``."""
    words = " ".join(s.text for s in cut.supervisions).split()
    asked = list(QUESTIONS)
    first, second = asked[index % 3], asked[(index + 1 + index // 3) % 3]
    turns = [
        {"from": "User", "type": "text", "value": first},
        {
            "from": "User",
            "type": "audio",
            "value": audio,
            "duration": cut.duration,
            "sampling_rate": cut.sampling_rate,
        },
        {"from": "Assistant", "type": "text", "value": QUESTIONS[first](words)},
    ]
    if follow_up and second != first:
        turns += [
            {"from": "User", "type": "text", "value": second},
            {"from": "Assistant", "type": "text", "value": QUESTIONS[second](words)},
        ]
    return {"id": f"qa-{cut.id}", "conversations": turns}


def write_split(corpus: Path, out: Path, split: str, seed: int) -> None:
    cuts = CutSet.from_file(corpus / f"cuts_{split}.jsonl.gz")
    lines = []
    for index, cut in enumerate(cuts):
        audio = corpus / cut.recording.sources[0].source
        relative = os.path.relpath(audio.resolve(), out.resolve())
        lines.append(conversation(cut, relative, index, follow_up=split == "train"))
    (out / f"conversations_{split}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    rng = random.Random(f"{seed}-{split}")
    pairs = [(rng.randrange(50), rng.randrange(50)) for _ in range(SUMS[split])]
    (out / f"sums_{split}.src.txt").write_text(
        "".join(f"What is {a} plus {b}?\n" for a, b in pairs)
    )
    (out / f"sums_{split}.tgt.txt").write_text("".join(f"{a + b}\n" for a, b in pairs))
    capitals = capital_pairs(split)
    (out / f"capitals_{split}.src.txt").write_text("".join(f"{q}\n" for q, _ in capitals))
    (out / f"capitals_{split}.tgt.txt").write_text("".join(f"{a}\n" for _, a in capitals))


def capital_pairs(split: str) -> list[tuple[str, str]]:
    """(question, answer) of each capital of ``split``: the held-out half for test, else the
    training half."""
    chosen = CAPITALS[1::2] if split == "test" else CAPITALS[::2]
    return [
        (CAPITAL_QUESTION.format(country=c), CAPITAL_ANSWER.format(country=c, city=city))
        for c, city in chosen
    ]


def mixture(asr: str, split: str, weights: dict[str, float] | None) -> str:
    """The source lines of the speech chat's sets of ``split``, weighted when ``weights``."""
    entries = {
        "asr": f"cuts: {asr}/cuts_{split}.jsonl.gz",
        "spoken": f"conversations: conversations_{split}.jsonl",
        "capitals": f"text_pairs: [capitals_{split}.src.txt, capitals_{split}.tgt.txt]",
    }
    names = list(weights) if weights else list(entries)
    return "".join(
        f"- {{name: {name}, {entries[name]}"
        + (f", weight: {weights[name]}}}\n" if weights else "}\n")
        for name in names
    )


def source_files(corpus: Path, out: Path) -> None:
    asr = os.path.relpath(corpus.resolve(), out.resolve())
    (out / "input_cfg.yaml").write_text(
        "# ASR, spoken conversations about it and text sums (recipes/make_conversations.py)\n"
        f"- {{name: asr, cuts: {asr}/cuts_train.jsonl.gz, weight: {WEIGHTS['asr']}}}\n"
        f"- {{name: spoken, conversations: conversations_train.jsonl, "
        f"weight: {WEIGHTS['spoken']}}}\n"
        f"- {{name: sums, text_pairs: [sums_train.src.txt, sums_train.tgt.txt], "
        f"weight: {WEIGHTS['sums']}}}\n"
    )
    for name, split in (("eval_sets", "dev"), ("test_sets", "test")):
        (out / f"{name}.yaml").write_text(
            f"- {{name: asr, cuts: {asr}/cuts_{split}.jsonl.gz}}\n"
            f"- {{name: spoken, conversations: conversations_{split}.jsonl}}\n"
            f"- {{name: sums, text_pairs: [sums_{split}.src.txt, sums_{split}.tgt.txt]}}\n"
        )
    header = "# ASR, spoken conversations and capitals (recipes/make_conversations.py)\n"
    (out / "speech_chat_input_cfg.yaml").write_text(header + mixture(asr, "train", SPEECH_CHAT))
    speech_only = {k: v for k, v in SPEECH_CHAT.items() if k != "capitals"}
    (out / "speech_chat_no_text_input_cfg.yaml").write_text(
        "# The speech chat's mixture without its text (recipes/make_conversations.py)\n"
        + mixture(asr, "train", speech_only)
    )
    (out / "speech_chat_eval_sets.yaml").write_text(mixture(asr, "dev", None))
    (out / "speech_chat_test_sets.yaml").write_text(mixture(asr, "test", None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=Path("data/corpus_asr"))
    parser.add_argument("--out", type=Path, default=Path("data/conversations"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not (args.corpus / "cuts_train.jsonl.gz").is_file():
        raise SystemExit(f"{args.corpus}: no cuts_train.jsonl.gz; run `make corpus-asr` first")
    args.out.mkdir(parents=True, exist_ok=True)
    for split in SUMS:
        write_split(args.corpus, args.out, split, args.seed)
    source_files(args.corpus, args.out)
    print(f"wrote conversations, sums, capitals and source files to {args.out}")


if __name__ == "__main__":
    main()
