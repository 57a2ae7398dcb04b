"""Conversation and text sources written from the session corpus, as users bring them: NeMo's
``multimodal_conversation`` JSON lines over the corpus's own audio (a spoken utterance in the
middle of a conversation or opening it, a second one in a later turn) and ``text_pairs`` files,
mixed with the corpus's ASR cuts (train/data/conversation_cuts.py)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from lhotse import CutSet

QUESTION = "What is said?"
FOLLOW_UP = "And the last word?"
TEXT_JOINED = 5  # utterances' transcripts in one text pair


def spoken_conversation(cut_id: str, spoken: list[tuple[str, float, str]], index: int) -> dict:
    """One NeMo multimodal conversation about ``spoken`` utterances (audio path, seconds,
    text): the first one's transcript and last word as two assistant turns; every other
    conversation opens with a text exchange, so that its audio sits in the middle; every third
    asks about a second utterance too, its audio in a later user turn."""
    audio, seconds, text = spoken[0]
    turns = [
        {"from": "User", "type": "text", "value": QUESTION},
        {"from": "User", "type": "audio", "value": audio, "duration": seconds},
        {"from": "Assistant", "type": "text", "value": text},
        {"from": "User", "type": "text", "value": FOLLOW_UP},
        {"from": "Assistant", "type": "text", "value": text.split()[-1]},
    ]
    if index % 2:
        turns = [
            {"from": "User", "type": "text", "value": "Hello."},
            {"from": "Assistant", "type": "text", "value": "Hello, ask away."},
            *turns,
        ]
    if index % 3 == 2:
        other, other_seconds, other_text = spoken[1]
        turns += [
            {"from": "User", "type": "text", "value": "And this one?"},
            {"from": "User", "type": "audio", "value": other, "duration": other_seconds},
            {"from": "Assistant", "type": "text", "value": other_text},
        ]
    return {"id": f"conv-{cut_id}", "conversations": turns}


def reversed_words(text: str) -> str:
    """The text pairs' task: the words in reverse order."""
    return " ".join(reversed(text.split()))


def write_split(corpus: Path, split: str, out: Path) -> dict[str, Path]:
    """The conversations (audio paths relative to their file) and text pairs of one corpus
    split."""
    out.mkdir(parents=True, exist_ok=True)
    cuts = CutSet.from_file(corpus / f"cuts_{split}.jsonl.gz")
    spoken = [
        (
            str((corpus / cut.recording.sources[0].source).resolve()),
            cut.duration,
            " ".join(s.text for s in cut.supervisions),
        )
        for cut in cuts
    ]
    conversations, sources, targets = [], [], []
    for index, cut in enumerate(cuts):
        pair = [spoken[index], spoken[(index + 1) % len(spoken)]]
        conversations.append(spoken_conversation(cut.id, pair, index))
        # Long enough (~5 s of the batch budget) that a batch often holds text alone.
        text = " ".join(spoken[(index + k) % len(spoken)][2] for k in range(TEXT_JOINED))
        sources.append(f"reverse: {text}")
        targets.append(reversed_words(text))
    paths = {
        "conversations": out / f"conversations_{split}.jsonl.gz",
        "source": out / f"source_{split}.txt",
        "target": out / f"target_{split}.txt",
    }
    with gzip.open(paths["conversations"], "wt", encoding="utf-8") as file:
        file.writelines(json.dumps(line) + "\n" for line in conversations)
    paths["source"].write_text("\n".join(sources) + "\n")
    paths["target"].write_text("\n".join(targets) + "\n")
    return paths


def conversation_mixture(corpus: Path, out: Path) -> tuple[Path, Path]:
    """``data.input_cfg`` (ASR 0.4, spoken conversations 0.3, text pairs 0.3, all from the train
    split) and ``eval.sets`` (the dev split's conversations and text pairs) files."""
    train, dev = (
        write_split(corpus, "train", out / "train"),
        write_split(corpus, "dev", out / "dev"),
    )
    mixture = out / "input_cfg.yaml"
    mixture.write_text(
        f"- {{name: asr, cuts: {corpus / 'cuts_train.jsonl.gz'}, weight: 0.4}}\n"
        f"- {{name: spoken, conversations: {train['conversations']}, weight: 0.3}}\n"
        f"- {{name: text, text_pairs: [{train['source']}, {train['target']}], weight: 0.3}}\n"
    )
    sets = out / "eval_sets.yaml"
    sets.write_text(
        f"- {{name: spoken, conversations: {dev['conversations']}}}\n"
        f"- {{name: text, text_pairs: [{dev['source']}, {dev['target']}]}}\n"
    )
    return mixture, sets
