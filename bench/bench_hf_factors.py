"""Why the pretrained-LLM path learns more slowly than the byte-level preset: the same 1,000 steps
for the preset, for a Hugging Face directory that *is* the preset's decoder, and for the recipe's
decoder with one factor at a time set back to the preset's (issue 36).

    python -m bench.bench_hf_factors --out runs/hf_factors                 # every variant
    python -m bench.bench_hf_factors --out runs/hf_factors --only preset,hf_preset

Each variant's decoder is written by ``recipes/make_hf_llm.py`` (its options name the factor),
trained with ``recipes/conf/asr_hf.yaml`` (``asr_tiny.yaml`` for the preset) on ``make
corpus-asr``'s corpus, 2 ranks under ``torchrun --standalone``, the same seed and init seed, and
scored by ``python -m train.evaluate`` on the test split at the last step. A variant whose
evaluation exists is not run again. The table gives the mean step time, the last validation's
loss in nats per dev utterance (val_loss is per target token, which differs between
vocabularies), WER and CER, and each WER as a ratio to the preset's.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.launcher import torchrun

REPO = Path(__file__).resolve().parents[1]
MAKER = REPO / "recipes" / "make_hf_llm.py"
INIT_SEED = 1234  # model.init_seed's default: the preset's initial weights

# The preset decoder's choices, as make_hf_llm.py options.
PRESET_SHAPE = ["--hidden", "64", "--ffn", "128"]
PRESET_EXACT = ["--vocab-multiple", "1", "--norm-eps", "1e-5", "--seed", str(INIT_SEED)]
PLAIN = ["model.system=null", "model.prompt=."]  # the plain format with a one-byte prompt

# name -> (what it is, make_hf_llm.py options or None for the byte-level preset, overrides)
VARIANTS: dict[str, tuple[str, list[str] | None, list[str]]] = {
    "preset": ("the byte-level preset (recipes/train_asr.yaml's model)", None, []),
    "hf_preset": (
        "the preset's decoder as a Hugging Face directory (Llama, bytes, plain format, preset "
        "init and shape, untied)",
        [
            "--family=llama",
            "--untied",
            "--tokenizer=bytes",
            "--template=none",
            "--init=preset",
            *PRESET_SHAPE,
            *PRESET_EXACT,
        ],
        PLAIN,
    ),
    "recipe": ("make hf-llm as it is (Qwen2, BPE, ChatML, hf init, hidden 128, tied)", [], []),
    "init": ("the recipe with the preset's init", ["--init=preset", "--seed", str(INIT_SEED)], []),
    "vocabulary": ("the recipe with bytes for tokens", ["--tokenizer=bytes"], []),
    "template": ("the recipe in the plain format", ["--template=none"], PLAIN),
    "width": ("the recipe at the preset's width", PRESET_SHAPE, []),
    "untied": ("the recipe with a head of its own", ["--untied"], []),
}


def run(args: list[str], log: Path) -> None:
    """Run a command into ``log``; a failure ends the benchmark with the log's tail."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with log.open("w") as out:
        done = subprocess.run(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(args)}\n{log.read_text()[-3000:]}")


def utterances(corpus: Path, split: str) -> int:
    with gzip.open(corpus / f"cuts_{split}.jsonl.gz", "rt") as cuts:
        return sum(1 for line in cuts if line.strip())


def variant(name: str, out: Path, corpus: Path, steps: int, seed: int, nproc: int) -> dict:
    """Make, train and score one variant (skipped where its evaluation exists)."""
    _, maker, overrides = VARIANTS[name]
    run_dir = out / name
    summary = run_dir / "eval" / f"step_{steps}" / "summary.json"
    if not summary.is_file():
        run_dir.mkdir(parents=True, exist_ok=True)
        train = ["--config-name", "asr_tiny"]
        if maker is not None:
            decoder = out / "decoders" / name
            decoder.parent.mkdir(exist_ok=True)
            make = [sys.executable, str(MAKER), "--corpus", str(corpus), "--out", str(decoder)]
            run([*make, *maker], run_dir / "make.log")
            train = ["--config-name", "asr_hf", f"model.pretrained_llm={decoder}", *overrides]
        started = time.monotonic()
        print(f"[{name}] training {steps} steps ...", file=sys.stderr, flush=True)
        run(
            [
                *torchrun(nproc),
                "-m",
                "train",
                *train,
                f"seed={seed}",
                f"run_dir={run_dir}",
                f"data.corpus={corpus}",
                f"train.max_steps={steps}",
                "train.max_time_per_run=0",
                f"checkpoint.interval={steps}",
                f"eval.interval={steps // 2}",
                "wandb.enabled=false",
            ],
            run_dir / "train.log",
        )
        print(f"[{name}] trained in {time.monotonic() - started:.0f} s; scoring", file=sys.stderr)
        run(
            [*torchrun(nproc), "-m", "train.evaluate", f"run_dir={run_dir}", f"step={steps}"],
            run_dir / "evaluate.log",
        )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [row for row in rows if "loss" in row and row.get("step_time_s") is not None]
    val = [row for row in rows if "val_loss" in row]
    scored = json.loads(summary.read_text())
    return {
        "step_s": sum(row["step_time_s"] for row in timed) / len(timed),
        "val_nats": val[-1]["val_loss"] * val[-1]["val_tokens"] / utterances(corpus, "dev"),
        "wer": scored["wer"],
        "cer": scored["cer"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="a folder for every variant")
    parser.add_argument("--corpus", type=Path, default=REPO / "data" / "corpus_asr")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--only", help="comma-separated variants (default: all)")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(VARIANTS)
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        sys.exit(f"error: unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    if not (args.corpus / "cuts_train.jsonl.gz").is_file():
        sys.exit(f"error: {args.corpus} has no cuts_train.jsonl.gz; make it (make corpus-asr)")
    out = args.out.resolve()
    results = {
        name: variant(name, out, args.corpus.resolve(), args.steps, args.seed, args.nproc)
        for name in names
    }
    base = results.get("preset")
    print(f"\n{args.steps} steps, seed {args.seed}, {args.nproc} ranks; test split")
    print("| variant | what | s/step | val nats/utt | WER % | CER % | WER / preset |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, got in results.items():
        ratio = f"{got['wer'] / base['wer']:.2f}" if base else "-"
        print(
            f"| {name} | {VARIANTS[name][0]} | {got['step_s']:.3f} | {got['val_nats']:.2f} | "
            f"{100 * got['wer']:.1f} | {100 * got['cer']:.1f} | {ratio} |"
        )


if __name__ == "__main__":
    main()
