"""WER against training time: evaluate every checkpoint a run kept and print the learning curve.

    python -m bench.bench_learning --run-dir runs/asr          # after recipes/train_asr.yaml
    python -m bench.bench_learning --run-dir runs/asr --nproc 2
    python -m bench.bench_learning --run-dir runs/asr_mix --nproc 2 --sets data/mix/test_sets.yaml

Each checkpoint without an evaluation gets one (``python -m train.evaluate step=N``, the run's
test split, under ``torchrun --standalone`` when ``--nproc`` > 1); existing
``eval/step_<N>/summary.json`` files are reused. With ``--sets FILE`` each checkpoint is scored on
every test set of FILE in one evaluation, and the table has a WER column per set. Training time at
step N is read from the run's ``metrics.jsonl``: the sum of the logged mean step times
(``step_time_s`` times the steps each row covers), so it leaves out start-up, checkpointing,
validation and the gaps between jobs; wall time is the time of the row at step N since the run's
first step began, and includes all of those.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def training_seconds(metrics: list[dict]) -> dict[int, float]:
    """Cumulative training time at each logged step (mean step time x steps per row)."""
    elapsed, previous, at = 0.0, 0, {}
    for row in metrics:
        if "loss" not in row or row.get("step_time_s") is None:
            continue
        elapsed += row["step_time_s"] * (row["step"] - previous)
        previous = row["step"]
        at[row["step"]] = elapsed
    return at


def evaluate(run_dir: Path, step: int, nproc: int, sets: Path | None) -> dict:
    summary = run_dir / "eval" / f"step_{step}" / "summary.json"
    if not summary.is_file():
        launcher = [sys.executable]
        if nproc > 1:
            launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        args = ["-m", "train.evaluate", f"run_dir={run_dir}", f"step={step}", "batch_size=32"]
        if sets is not None:
            args.append(f"sets={sets}")
        done = subprocess.run([*launcher, *args], cwd=REPO, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"evaluation of step {step} failed:\n{done.stderr[-3000:]}")
    return json.loads(summary.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--sets", type=Path, help="a test-set source file (train.evaluate sets=)")
    args = parser.parse_args()
    sets = None if args.sets is None else args.sets.resolve()
    run_dir = args.run_dir.resolve()
    steps = sorted(
        int(marker.parent.name.removeprefix("step_"))
        for marker in (run_dir / "checkpoints").glob("step_*/COMPLETE")
    )
    if not steps:
        sys.exit(f"error: no complete checkpoint in {run_dir / 'checkpoints'}")
    metrics = rows(run_dir)
    trained = training_seconds(metrics)
    first = next(row for row in metrics if "loss" in row)
    start = first["time"] - trained[first["step"]]  # the first row's steps began before it
    wall = {row["step"]: row["time"] - start for row in metrics if "loss" in row}
    val = {row["step"]: row["val_loss"] for row in metrics if "val_loss" in row}
    names = [] if sets is None else list(evaluate(run_dir, steps[-1], args.nproc, sets)["sets"])
    print("| step | training min | wall min | val_loss | WER % | CER % |", end="")
    print("".join(f" {name} WER % |" for name in names))
    print("|---:|---:|---:|---:|---:|---:|" + "---:|" * len(names))
    for step in steps:
        summary = evaluate(run_dir, step, args.nproc, sets)
        known = [s for s in trained if s <= step]
        minutes = trained[max(known)] / 60 if known else float("nan")
        wall_min = wall[max(known)] / 60 if known else float("nan")
        loss = f"{val[step]:.4f}" if step in val else "-"
        print(
            f"| {step} | {minutes:.1f} | {wall_min:.1f} | {loss} | {100 * summary['wer']:.1f} | "
            f"{100 * summary['cer']:.1f} |"
            + "".join(f" {100 * summary['sets'][name]['wer']:.1f} |" for name in names),
            flush=True,
        )


if __name__ == "__main__":
    main()
