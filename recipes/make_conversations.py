"""Spoken conversations and text instructions from the ASR corpus (`make corpus-asr`), for a
speech LLM trained as NeMo's SALM is: speech, conversations about it and text, mixed
(recipes/conf/conversations_whisper.yaml; docs/training.md, "Conversations and text").

    python recipes/make_conversations.py --corpus data/corpus_asr --out data/conversations

For each utterance of a split, a conversation in NeMo's ``multimodal_conversation`` JSON lines:
the user asks a question about the audio (its first word, its last word, or how many words it
has) and the assistant answers, a function of what is said; in the train split a second question
follows as a text turn. Text instructions are sums of two numbers below 50 ("What is 12 plus
7?" -> "19"), as ``text_pairs`` files. The source files name their data relative to themselves:

- ``input_cfg.yaml``: ASR 0.6, conversations 0.25, sums 0.15 (train splits);
- ``eval_sets.yaml`` (validation in the loop) and ``test_sets.yaml`` (``train.evaluate``): each
  split's ASR, conversations and sums as sets of their own.
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
    print(f"wrote conversations, sums and source files to {args.out}")


if __name__ == "__main__":
    main()
