"""Decoding throughput on CPU: utterances/s and real-time factor, KV cache on and off, at one
process and two data-parallel ranks.

    python -m bench.bench_decode                         # trains a tiny model first (~1 min)
    python -m bench.bench_decode --run-dir RUN_DIR       # a trained run of your own
    python -m bench.bench_decode --quick                 # smoke run: 20 steps, 16 utterances

Each row is one ``python -m train.evaluate`` (under ``torchrun --standalone`` for dp2) over the
same manifest and checkpoint, read back from its ``summary.json``: ``decode_s`` is rank 0's wall
time from its first batch to its last (model building and checkpoint loading excluded),
utterances/s the manifest's utterances over it, the real-time factor that time over the seconds
of audio decoded. The baseline is one process without the cache (every step recomputes the
whole sequence); the ratio column is each row's utterances/s over it. Without ``--run-dir`` a
tiny model is trained for ``--steps`` steps on ``--corpus`` first, so that it emits transcripts
of a realistic length (an untrained one runs to ``--max-new-tokens`` every time). Rank count 2
shares this machine's cores, one thread per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(args: list[str], nproc: int = 1) -> None:
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run([*launcher, *args], cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"failed: {' '.join(args)}\n{result.stderr[-3000:]}")


def train(run_dir: Path, corpus: Path, steps: int) -> None:
    print(f"training a tiny model for {steps} steps on {corpus} ...", flush=True)
    run(
        [
            "-m",
            "train",
            f"run_dir={run_dir}",
            f"data.corpus={corpus}",
            "data.max_duration=30",
            f"train.max_steps={steps}",
            f"checkpoint.interval={steps}",
            "wandb.mode=disabled",
        ]
    )


def evaluate(run_dir: Path, nproc: int, kv_cache: bool, extra: list[str]) -> dict:
    args = ["-m", "train.evaluate", f"run_dir={run_dir}", f"kv_cache={str(kv_cache).lower()}"]
    run([*args, *extra], nproc)
    newest = max((run_dir / "eval").glob("step_*/summary.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(newest.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, help="a trained run (default: train one)")
    parser.add_argument("--corpus", type=Path, default=REPO / "data" / "corpus")
    parser.add_argument("--steps", type=int, default=400, help="training steps without --run-dir")
    parser.add_argument("--inputs", type=Path, help="a cut manifest (default: the test split)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        run_dir = args.run_dir
        if run_dir is None:
            run_dir = Path(scratch) / "run"
            train(run_dir, args.corpus, 20 if args.quick else args.steps)
        extra = [f"batch_size={args.batch_size}", f"max_new_tokens={args.max_new_tokens}"]
        if args.inputs:
            extra.append(f"inputs={args.inputs}")
        rows = []
        for nproc in (1, 2):
            for kv_cache in (False, True):
                summary = evaluate(run_dir, nproc, kv_cache, extra)
                rows.append((nproc, kv_cache, summary))
                print(
                    f"  dp{nproc} kv_cache={kv_cache}: {summary['utterances_per_s']:.1f} utt/s",
                    flush=True,
                )
    baseline = rows[0][2]["utterances_per_s"]
    first = rows[0][2]
    print(
        f"\n{first['num_utterances']} utterances of {first['split']} at step {first['step']}, "
        f"batch {args.batch_size}, up to {args.max_new_tokens} new tokens; WER "
        f"{100 * first['wer']:.1f}%\n"
    )
    print("| ranks | KV cache | utt/s | real-time factor | utt/s vs 1 rank, no cache |")
    print("|---:|---|---:|---:|---:|")
    for nproc, kv_cache, summary in rows:
        print(
            f"| {nproc} | {'on' if kv_cache else 'off'} | {summary['utterances_per_s']:.1f} | "
            f"{summary['real_time_factor']:.4f} | {summary['utterances_per_s'] / baseline:.2f} |"
        )


if __name__ == "__main__":
    main()
