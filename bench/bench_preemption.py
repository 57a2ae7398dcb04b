"""Preemption: how long a requeueable chain job is away, and how many steps it loses.

On a loopback cluster with a preemptible partition (``orchestrator cluster up --preemption``), a
one-job chain of the tiny FSDP2 recipe with ``requeue: true`` trains; at step ``--at`` a job of
the urgent partition asks for the whole node. The trainer saves on SLURM's SIGTERM, the end hook
requeues the job, SLURM holds it ``cred_expire`` + 1 s, and it resumes. Printed per round:

- seconds from the urgent job's submission to the chain's job running again (its requeued run's
  start hook), against SLURM's own requeue hold (the baseline: nothing can be back sooner);
- of which: submission to the save on SIGTERM (the preemption and the save);
- steps lost: steps the first run trained past the step the requeued run resumed from.

    python -m bench.bench_preemption [--corpus data/corpus] [--rounds 2] [--at 6]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.loopback import bench_cluster
from orchestrator.cluster.config import REQUEUE_HOLD_S, URGENT_PARTITION

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "train_tiny_fsdp2.yaml"
TIMEOUT_S = 600


def wait_for(check, what: str, timeout: float = TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        if time.monotonic() > deadline:
            raise SystemExit(f"error: no {what} after {timeout:.0f} s")
        time.sleep(0.2)
    return found


def trained_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row["step"] for row in rows if "loss" in row]


def one_round(work: Path, corpus: Path, at: int, index: int) -> dict:
    recipe = work / f"requeue-{index}.yaml"
    recipe.write_text(RECIPE.read_text() + "requeue: true\n")
    run_dir = work / f"run-{index}"
    training = [f"data.corpus={corpus}", "data.max_duration=8", "wandb.mode=offline"]
    training += ["train.max_steps=40", "checkpoint.interval=50"]
    launch = ["-n1", "--json", "--run-dir", str(run_dir), str(recipe), "--", *training]
    launched = subprocess.run(
        [str(BIN / "auto_launch"), *launch],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    )
    job_id = json.loads(launched.stdout.splitlines()[-1])["jobs"][0]["job_id"]
    wait_for(lambda: any(step >= at for step in trained_steps(run_dir)), f"step {at}")
    urgent = ["sbatch", "-p", URGENT_PARTITION, "--exclusive", "-o", "/dev/null", "--wrap", "true"]
    submitted = time.monotonic()
    subprocess.run(urgent, check=True, capture_output=True)
    log = run_dir / "logs" / f"{recipe.stem}-{job_id}.out"
    saved_line = r"was preempted: training stopped on SIGTERM after saving step (\d+)"
    saved = int(wait_for(lambda: re.search(saved_line, log.read_text()), "save on SIGTERM")[1])
    saved_after = time.monotonic() - submitted
    first_run = max(trained_steps(run_dir))  # the requeued run has not started yet
    wait_for(lambda: "was requeued (restart 1)" in log.read_text(), "requeued run")
    back_after = time.monotonic() - submitted
    resumed_line = r"resumed from \S+ at step (\d+)"
    resumed = int(wait_for(lambda: re.search(resumed_line, log.read_text()), "resume")[1])
    lost = first_run - resumed
    subprocess.run(["scancel", job_id], check=False)
    return {"back_s": back_after, "saved_s": saved_after, "saved_at": saved, "lost": lost}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=REPO / "data" / "corpus")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--at", type=int, default=6, help="preempt once this step is logged")
    args = parser.parse_args()
    if not (args.corpus / "cuts_train.jsonl.gz").is_file():
        raise SystemExit(f"error: no corpus in {args.corpus}: run `make corpus` or give --corpus")
    with tempfile.TemporaryDirectory(prefix="bench-preempt-") as tmp:
        work = Path(tmp)
        with bench_cluster(work, nodes=1, cpus_per_node=2, preemption=True):
            rounds = [
                one_round(work, args.corpus.resolve(), args.at, i) for i in range(args.rounds)
            ]
    for index, result in enumerate(rounds):
        print(
            f"round {index}: preempted at step {result['saved_at']}, saved "
            f"{result['saved_s']:.1f} s after the urgent job came, running again after "
            f"{result['back_s']:.1f} s, {result['lost']} step(s) lost"
        )
    back = statistics.median(result["back_s"] for result in rounds)
    print(
        f"preemption to running again: {back:.1f} s (median of {len(rounds)}), against SLURM's "
        f"requeue hold of {REQUEUE_HOLD_S} s: ratio {back / REQUEUE_HOLD_S:.2f}; steps lost: "
        f"{max(result['lost'] for result in rounds)} at most"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
