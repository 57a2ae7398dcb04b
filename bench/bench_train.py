"""Training entrypoint benchmarks on CPU, one process, each against its baseline in the same run.

1. Throughput: steady-state decoder positions per second of ``python -m train`` against a minimal
   hand-written PyTorch loop: the same model preset, the same batches (same corpus, seed and
   sampler), AdamW, no framework. Each runs in a fresh process of its own, in alternating order.
   Target ratio >= 0.95.
2. Resume cost: seconds from process start to the first completed step when resuming from a
   checkpoint, against a fresh start of the same run. Target ratio <= 1.3.

    python -m bench.bench_train [--corpus data/corpus] [--preset small] [--steps 30] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WARMUP_STEPS = 5


def run_entrypoint(run_dir: Path, args: argparse.Namespace, *overrides: str) -> float:
    """Run ``python -m train``; return the wall-clock time at which the process was started."""
    argv = [
        sys.executable,
        "-m",
        "train",
        "--config-name",
        "tiny_fsdp2",
        f"run_dir={run_dir}",
        f"data.corpus={args.corpus}",
        f"model.preset={args.preset}",
        "seed=3",
        f"data.max_duration={args.max_duration}",
        "checkpoint.interval=100000",
        "wandb.mode=offline",
        *overrides,
    ]
    started = time.time()
    completed = subprocess.run(
        argv, cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    if completed.returncode != 0:
        raise SystemExit(f"python -m train failed:\n{completed.stderr[-3000:]}")
    return started


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def steady_rate(rows: list[dict]) -> float:
    """Positions per second over the steps after warm-up: total positions / total step time."""
    steady = rows[WARMUP_STEPS:]
    positions = sum(row["tokens_per_s"] * row["step_time_s"] for row in steady)
    return positions / sum(row["step_time_s"] for row in steady)


def hand_written_loop(args: argparse.Namespace) -> float:
    """The baseline: the same model and batches in a plain loop, timed the same way."""
    import torch

    from train.data.loader import build_dataloader
    from train.data.text import ByteTokenizer
    from train.models.batch import Batch
    from train.models.build import build_model
    from train.models.packing import example_positions
    from train.models.presets import get_preset

    cfg = get_preset(args.preset)
    model = build_model(cfg, torch.device("cpu"), 1234)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    loader = build_dataloader(
        Path(args.corpus) / "cuts_train.jsonl.gz",
        max_duration=args.max_duration,
        job_seed=3,
        dp_rank=0,
        dp_size=1,
        num_workers=0,
        text=ByteTokenizer(),
    )
    batches = iter(loader)
    positions, seconds = 0.0, 0.0
    for step in range(args.steps):
        started = time.perf_counter()
        batch = next(batches)
        out = model(Batch.of(batch))
        (out.nll_sum / out.num_tokens + out.aux_sum / len(batch["token_lens"])).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - started
        if step >= WARMUP_STEPS:
            audio = example_positions(cfg, batch["feature_lens"])
            positions += float((audio + batch["token_lens"]).sum())
            seconds += elapsed
    return positions / seconds


def hand_written_in_subprocess(args: argparse.Namespace) -> float:
    """The baseline in a fresh process, like the entrypoint, so neither starts warmer."""
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.bench_train",
            "--hand-written-only",
            "--corpus",
            args.corpus,
            "--preset",
            args.preset,
            "--steps",
            str(args.steps),
            "--max-duration",
            str(args.max_duration),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=REPO,
    )
    if completed.returncode != 0:
        raise SystemExit(f"hand-written loop failed:\n{completed.stderr[-3000:]}")
    return float(completed.stdout.strip().splitlines()[-1])


def first_step_latency(run_dir: Path, started: float, after_step: int) -> float:
    row = next(row for row in metrics(run_dir) if row["step"] > after_step)
    return row["time"] - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default=str(REPO / "data/corpus"))
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--max-duration", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hand-written-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not (Path(args.corpus) / "cuts_train.jsonl.gz").exists():
        raise SystemExit(f"no corpus at {args.corpus}: run `make corpus` first")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    if args.hand_written_only:
        print(hand_written_loop(args))
        return
    work = Path(tempfile.mkdtemp(prefix="bench-train-"))

    print(f"throughput: preset {args.preset}, {args.steps} steps, first {WARMUP_STEPS} dropped")
    ours, baseline = [], []
    for repeat in range(args.repeats):
        run_dir = work / f"throughput{repeat}"
        if repeat % 2:
            baseline.append(hand_written_in_subprocess(args))
        run_entrypoint(run_dir, args, f"train.max_steps={args.steps}")
        ours.append(steady_rate(metrics(run_dir)))
        if not repeat % 2:
            baseline.append(hand_written_in_subprocess(args))
        print(
            f"  repeat {repeat + 1}: entrypoint {ours[-1]:.0f} pos/s, "
            f"hand-written {baseline[-1]:.0f} pos/s",
            flush=True,
        )
    ratio = statistics.median(ours) / statistics.median(baseline)
    print(
        f"  median: entrypoint {statistics.median(ours):.0f}, hand-written "
        f"{statistics.median(baseline):.0f} positions/s; ratio {ratio:.3f} (target >= 0.95)"
    )

    print("resume cost: process start -> first completed step")
    fresh, resumed = [], []
    for repeat in range(args.repeats):
        run_dir = work / f"resume{repeat}"
        started = run_entrypoint(run_dir, args, "train.max_steps=4")
        fresh.append(first_step_latency(run_dir, started, 0))
        started = run_entrypoint(run_dir, args, "train.max_steps=8")
        resumed.append(first_step_latency(run_dir, started, 4))
        print(
            f"  repeat {repeat + 1}: fresh {fresh[-1]:.2f} s, resumed {resumed[-1]:.2f} s",
            flush=True,
        )
    ratio = statistics.median(resumed) / statistics.median(fresh)
    print(
        f"  median: fresh {statistics.median(fresh):.2f} s, resumed "
        f"{statistics.median(resumed):.2f} s; ratio {ratio:.3f} (target <= 1.3)"
    )


if __name__ == "__main__":
    main()
