"""Submission cost of a chain: `auto_launch -n8` against 8 plain sbatch calls in a shell loop.

Both submit the same 8-job afterany chain of the same trivial .sub to the loopback cluster, in
alternating order, and the median wall time over several rounds is compared. Jobs are cancelled
between rounds, outside the timed part. Uses $SLURM_CONF when set, else starts (and stops) a
private cluster with `orchestrator cluster up`.

    python bench/bench_chain_submit.py [--rounds 7] [--jobs 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
RECIPE = """#!/bin/bash
#SBATCH --time=00:05:00
SEED=${1:?seed required}
true
"""
SHELL_LOOP = """
prev=""
for i in $(seq 0 $((N - 1))); do
  dep=""
  if [ -n "$prev" ]; then dep="--dependency=afterany:$prev"; fi
  prev=$(sbatch --parsable --job-name=loop --output="$RUN/loop-%j.out" $dep "$RECIPE" "$RANDOM")
done
"""


def cancel_all() -> None:
    subprocess.run(["scancel", "--user", os.environ.get("USER", "root")], check=False)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        queue = subprocess.run(
            ["squeue", "--noheader", "-h", "-o", "%i"], capture_output=True, text=True
        ).stdout.split()
        if not queue:
            return
        time.sleep(0.3)


def timed(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    completed = subprocess.run(argv, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if completed.returncode != 0:
        raise SystemExit(f"{argv[0]} failed: {completed.stderr.strip()}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--jobs", type=int, default=8)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-chain-"))
    recipe = work / "bench.sub"
    recipe.write_text(RECIPE)
    env = {
        **os.environ,
        "ORCH_HOME": str(work / "home"),
        "N": str(args.jobs),
        "RUN": str(work),
        "RECIPE": str(recipe),
    }
    own_cluster = "SLURM_CONF" not in os.environ
    if own_cluster:
        cluster_dir = work / "cluster"
        print(f"starting a loopback cluster in {cluster_dir}", flush=True)
        subprocess.run([BIN / "orchestrator", "cluster", "up", "--dir", cluster_dir], check=True)
        conf = subprocess.run(
            [BIN / "orchestrator", "cluster", "env", "--dir", cluster_dir],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        env["SLURM_CONF"] = os.environ["SLURM_CONF"] = conf.strip().split("=", 1)[1]
    try:
        ours: list[float] = []
        loop: list[float] = []
        cancel_all()
        for round_index in range(args.rounds):
            for name in ("ours", "loop") if round_index % 2 == 0 else ("loop", "ours"):
                if name == "ours":
                    ours.append(
                        timed(
                            [
                                str(BIN / "auto_launch"),
                                f"-n{args.jobs}",
                                "--run-dir",
                                str(work / f"run{round_index}"),
                                str(recipe),
                            ],
                            env,
                        )
                    )
                else:
                    loop.append(timed(["bash", "-c", SHELL_LOOP], env))
                cancel_all()
            print(
                f"round {round_index + 1}/{args.rounds}: auto_launch {ours[-1]:.3f} s, "
                f"sbatch loop {loop[-1]:.3f} s",
                flush=True,
            )
        ours_median, loop_median = statistics.median(ours), statistics.median(loop)
        print(f"\nauto_launch -n{args.jobs}: median {ours_median:.3f} s over {args.rounds} rounds")
        print(f"sbatch loop x{args.jobs}:  median {loop_median:.3f} s over {args.rounds} rounds")
        print(f"ratio (auto_launch / loop): {ours_median / loop_median:.2f}  (target <= 1.2)")
    finally:
        if own_cluster:
            subprocess.run(
                [BIN / "orchestrator", "cluster", "down", "--dir", work / "cluster"], check=False
            )


if __name__ == "__main__":
    main()
