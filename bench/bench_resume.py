"""Resume cost at the end of an epoch: the data position is restored, not replayed.

Seconds from process start to the first completed step of ``python -m train`` (tiny preset, one
process) resumed at the end of the first epoch of a 6,000-utterance corpus, over the same for a
fresh start. Target ratio <= 1.1. The trainer saves the end of an epoch as the start of the next
one (it reads one batch ahead), so the bench also times the positions that still walk the
samplers: one batch before the end of the epoch (the worst case), and the end of the epoch as
older checkpoints hold it (batch E of E). A resume at the start of the epoch gives the part that
does not depend on the position (loading the checkpoint). With ``--against REF`` the code of git
ref REF is timed at the end of the epoch too (e.g. the version that dropped batches one by one).

Each resume checkpoint is made by training one step and then moving the data position in its
``state.json`` (the epoch's length counted from the sampler, without loading features), so the
bench does not train a whole epoch first.

    python -m bench.bench_resume [--corpus data/corpus_6000] [--num 6000] [--repeats 3]
        [--against HEAD]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SEED = 3
MAX_DURATION = 12.0  # tiny_fsdp2's data.max_duration
BUCKETS = 4


def ensure_corpus(corpus: Path, num: int) -> None:
    if (corpus / "cuts_train.jsonl.gz").exists():
        return
    print(f"making a {num}-utterance corpus in {corpus} (takes minutes)", flush=True)
    subprocess.run(
        [sys.executable, "recipes/make_corpus.py", "--out", str(corpus), "--num", str(num)],
        cwd=REPO,
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )


def epoch_batches(corpus: Path) -> int:
    """Batches in epoch 0 of the one-process run, counted by the sampler (no features read)."""
    from train.data.loader import build_dataloader
    from train.data.text import ByteTokenizer

    loader = build_dataloader(
        corpus / "cuts_train.jsonl.gz",
        max_duration=MAX_DURATION,
        job_seed=SEED,
        dp_rank=0,
        dp_size=1,
        num_workers=0,
        text=ByteTokenizer(),
        buckets=BUCKETS,
    )
    return sum(1 for _ in loader.sampler)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a running process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def first_step_seconds(
    run_dir: Path, corpus: Path, code: Path, *overrides: str
) -> tuple[float, float]:
    """Run ``python -m train`` from the tree at ``code``; wall-clock and CPU seconds from its
    start to the first step it completed (its metrics line). The trainer runs on one thread, so
    on a machine shared with other work its CPU seconds are the steadier figure."""
    argv = [
        sys.executable,
        "-m",
        "train",
        "--config-name",
        "tiny_fsdp2",
        f"run_dir={run_dir}",
        f"data.corpus={corpus}",
        f"data.max_duration={MAX_DURATION}",
        f"data.buckets={BUCKETS}",
        f"seed={SEED}",
        "checkpoint.interval=100000",
        "wandb.mode=offline",
        *overrides,
    ]
    metrics = run_dir / "metrics.jsonl"
    before = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    log = run_dir.parent / f"{run_dir.name}.log"
    started = time.time()
    with log.open("w") as stderr:
        process = subprocess.Popen(
            argv,
            cwd=code,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(code)},
        )
        cpu = None
        while cpu is None and process.poll() is None:
            time.sleep(0.005)
            lines = metrics.read_text().splitlines()[before:] if metrics.exists() else []
            if any('"loss"' in line for line in lines):
                cpu = cpu_seconds(process.pid)
        if process.wait() != 0 or cpu is None:
            raise RuntimeError(f"python -m train failed:\n{log.read_text()[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()[before:]]
    return next(row["time"] for row in rows if "loss" in row) - started, cpu


def move_position(checkpoint: Path, epoch: int, batches: int) -> None:
    """Put the checkpoint's data position ``batches`` into ``epoch`` (one stream, one rank)."""
    state_file = checkpoint / "state.json"
    state = json.loads(state_file.read_text())
    position = {"epoch": epoch, "batch_in_epoch": batches, "streams": [batches], "next_stream": 0}
    trainer_state = state["trainer_state"]
    trainer_state["data_position"] = {**position, "data_seed": SEED}
    trainer_state["data_positions"] = [position]
    state_file.write_text(json.dumps(state, indent=1))


def checkpoint_at(work: Path, name: str, template: Path, epoch: int, batches: int) -> Path:
    """A copy of the one-step run ``template`` whose checkpoint sits ``batches`` into ``epoch``."""
    run_dir = work / name
    shutil.copytree(template, run_dir)
    move_position(run_dir / "checkpoints" / "step_1", epoch, batches)
    return run_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=REPO / "data/corpus_6000")
    parser.add_argument("--num", type=int, default=6000, help="utterances, if it must be made")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--against", help="git ref whose trainer is timed at the epoch end too")
    args = parser.parse_args()
    corpus = args.corpus.resolve()
    ensure_corpus(corpus, args.num)
    batches = epoch_batches(corpus)
    print(f"corpus {corpus}: epoch 0 has {batches} batches of <= {MAX_DURATION} s", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-resume-"))
    template = work / "template"
    first_step_seconds(template, corpus, REPO, "train.max_steps=2", "train.max_steps_per_run=1")
    cases = {
        "fresh": (REPO, None),
        "resumed at the start of epoch 0": (REPO, (0, 0)),
        "resumed one batch before the end of epoch 0": (REPO, (0, batches - 1)),
        "resumed at the end of epoch 0 (as saved: epoch 1, batch 0)": (REPO, (1, 0)),
        f"resumed at the end of epoch 0 (old format: batch {batches})": (REPO, (0, batches)),
    }
    if args.against:
        against = work / "against"
        against.mkdir()
        archive = subprocess.run(
            ["git", "archive", args.against], cwd=REPO, capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(against)], input=archive.stdout, check=True)
        cases[f"resumed at the end of epoch 0 by {args.against}"] = (against, (0, batches))
    times: dict[str, list[tuple[float, float]]] = {key: [] for key in cases}
    for repeat in range(args.repeats):
        order = list(cases) if repeat % 2 == 0 else list(reversed(cases))  # no case always first
        for index, key in enumerate(order):
            code, position = cases[key]
            name = f"run{repeat}-{index}"
            if position is None:
                overrides = ("train.max_steps=2", "train.max_steps_per_run=1")
                times[key].append(first_step_seconds(work / name, corpus, code, *overrides))
            else:
                run_dir = checkpoint_at(work, name, template, *position)
                times[key].append(first_step_seconds(run_dir, corpus, code, "train.max_steps=2"))
        print(
            f"  repeat {repeat + 1} (wall/CPU s): "
            + ", ".join(f"{k} {v[-1][0]:.2f}/{v[-1][1]:.2f}" for k, v in times.items()),
            flush=True,
        )
    medians = {
        key: [statistics.median(run[i] for run in runs) for i in (0, 1)]
        for key, runs in times.items()
    }
    fresh_wall, fresh_cpu = medians["fresh"]
    print(f"median time to first step: fresh start {fresh_wall:.2f} s wall, {fresh_cpu:.2f} s CPU")
    for key, (wall, cpu) in medians.items():
        print(
            f"  {key}: {wall:.2f} s wall (ratio {wall / fresh_wall:.3f}), "
            f"{cpu:.2f} s CPU (ratio {cpu / fresh_cpu:.3f})"
        )
    wall, cpu = medians["resumed at the end of epoch 0 (as saved: epoch 1, batch 0)"]
    print(
        f"ratio resumed at the end of an epoch / fresh: {wall / fresh_wall:.3f} wall, "
        f"{cpu / fresh_cpu:.3f} CPU (target <= 1.1)"
    )
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
