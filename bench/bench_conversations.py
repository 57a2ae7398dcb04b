"""A speech LLM trained on speech, conversations and text against one trained on speech alone:
each source's validation loss over the run, and the test sets scored at the end.

    python -m bench.bench_conversations --mixture runs/conv_whisper --speech runs/asr_whisper \\
        --nproc 2

``--mixture`` is a run of recipes/conf/conversations_whisper.yaml (`make conversations`),
``--speech`` one of recipes/conf/asr_whisper.yaml of the same number of steps. The last complete
checkpoint of each is evaluated (``python -m train.evaluate``, reused when its summary exists):
the mixture on data/conversations/test_sets.yaml (the corpus's ASR test split, spoken questions
about it, text sums), the speech run on its test split. Printed: the mixture's validation loss
per source at each validation, then WER and SER (the share of answers not exactly right) per
test set, and the ratio of the two runs' WER on the same ASR test split (the baseline: the
speech-only run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.bench_learning import evaluate, rows

REPO = Path(__file__).resolve().parents[1]

TEST_SETS = REPO / "data" / "conversations" / "test_sets.yaml"


def last_step(run_dir: Path) -> int:
    steps = [
        int(marker.parent.name.removeprefix("step_"))
        for marker in (run_dir / "checkpoints").glob("step_*/COMPLETE")
    ]
    if not steps:
        sys.exit(f"error: no complete checkpoint in {run_dir / 'checkpoints'}")
    return max(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixture", type=Path, required=True)
    parser.add_argument("--speech", type=Path, required=True)
    parser.add_argument("--nproc", type=int, default=1)
    args = parser.parse_args()
    mixture, speech = args.mixture.resolve(), args.speech.resolve()

    validations = [row for row in rows(mixture) if "val_loss" in row]
    names = [key.removeprefix("val_loss/") for key in validations[0] if key.startswith("val_loss/")]
    print("| step | " + " | ".join(f"val_loss/{name}" for name in names) + " |")
    print("|---:|" + "---:|" * len(names))
    seen = set()
    for row in validations:
        if row["step"] in seen:
            continue
        seen.add(row["step"])
        cells = " | ".join(f"{row[f'val_loss/{name}']:.4f}" for name in names)
        print(f"| {row['step']} | {cells} |")

    mixed = evaluate(mixture, last_step(mixture), args.nproc, TEST_SETS)
    alone = evaluate(speech, last_step(speech), args.nproc, None)
    print("\n| run | test set | utterances | WER % | SER % |")
    print("|---|---|---:|---:|---:|")
    for name, summary in mixed["sets"].items():
        print(
            f"| mixture | {name} | {summary['num_utterances']} | {100 * summary['wer']:.2f} | "
            f"{100 * summary['ser']:.2f} |"
        )
    print(
        f"| speech only | {alone['split']} | {alone['num_utterances']} | "
        f"{100 * alone['wer']:.2f} | {100 * alone['ser']:.2f} |"
    )
    ratio = mixed["sets"]["asr"]["wer"] / alone["wer"]
    print(f"\nASR test WER, mixture / speech only (the baseline): {ratio:.2f}")
    print(json.dumps({"wer_ratio": ratio}))


if __name__ == "__main__":
    main()
