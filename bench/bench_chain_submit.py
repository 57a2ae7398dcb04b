"""Submission cost of a chain: `auto_launch -nN` against N plain sbatch calls in a shell loop.

Both submit the same N-job afterany chain of the same trivial .sub to the loopback cluster, in
alternating order, and the median wall time over several rounds is compared, for each N given.
From the smallest and the largest N it prints the marginal cost of one more job,
``(T_large - T_small) / (large - small)``, for both, and their ratio (target <= 1.2). Then the
fixed cost of a YAML training recipe: ``auto_launch --dry-run`` on the local backend with the
plan check (which composes the trainer's config and prices its layout) and without it, against
the target of 0.3 s. Then the code snapshot's cost: ``auto_launch -n8`` of this repository's
own smoke recipe, run from the repository's root, with the snapshot (the default) against
``--code live`` (target: at most 1.5 s extra). Jobs are cancelled between rounds, outside the
timed part. Uses $SLURM_CONF when set, else starts (and stops) a private cluster with
`orchestrator cluster up`.

    python -m bench.bench_chain_submit [--rounds 7] [--jobs 8 100] [--only snapshot]
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

from bench.loopback import bench_cluster

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]
TRAINING_RECIPE = REPO / "recipes" / "train_tiny_fsdp2.yaml"
SMOKE_RECIPE = REPO / "recipes" / "smoke.yaml"  # fits the bench's 1-CPU nodes
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


def submission_medians(
    jobs: int, rounds: int, work: Path, recipe: Path, env: dict[str, str]
) -> dict[str, float]:
    """The median seconds of ``auto_launch -n{jobs}`` and of the sbatch loop, alternating."""
    times: dict[str, list[float]] = {"ours": [], "loop": []}
    env = {**env, "N": str(jobs)}
    cancel_all()
    for round_index in range(rounds):
        for name in ("ours", "loop") if round_index % 2 == 0 else ("loop", "ours"):
            if name == "ours":
                run_dir = work / f"run{jobs}-{round_index}"
                argv = [str(BIN / "auto_launch"), f"-n{jobs}", "--run-dir", str(run_dir)]
                times["ours"].append(timed([*argv, str(recipe)], env))
            else:
                times["loop"].append(timed(["bash", "-c", SHELL_LOOP], env))
            cancel_all()
        print(
            f"{jobs} jobs, round {round_index + 1}/{rounds}: auto_launch "
            f"{times['ours'][-1]:.3f} s, sbatch loop {times['loop'][-1]:.3f} s",
            flush=True,
        )
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(
        f"{jobs} jobs: auto_launch median {medians['ours']:.3f} s, sbatch loop "
        f"{medians['loop']:.3f} s; ratio {medians['ours'] / medians['loop']:.2f}",
        flush=True,
    )
    return medians


def snapshot_cost(rounds: int, work: Path, env: dict[str, str]) -> None:
    """``auto_launch -n8`` of the repository's smoke recipe from its root: snapshot against
    ``--code live``, alternating, medians."""
    times: dict[str, list[float]] = {"snapshot": [], "live": []}
    cancel_all()
    for round_index in range(rounds):
        order = ("snapshot", "live") if round_index % 2 == 0 else ("live", "snapshot")
        for code in order:
            run_dir = work / f"code-{code}-{round_index}"
            argv = [str(BIN / "auto_launch"), "-n8", "--code", code]
            argv += ["--run-dir", str(run_dir), str(SMOKE_RECIPE)]
            started = time.perf_counter()
            done = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True)
            times[code].append(time.perf_counter() - started)
            if done.returncode != 0:
                raise SystemExit(f"auto_launch failed: {done.stderr.strip()}")
            cancel_all()
    medians = {code: statistics.median(values) for code, values in times.items()}
    extra = medians["snapshot"] - medians["live"]
    print(
        f"\nauto_launch -n8 {SMOKE_RECIPE.name} from {REPO}: snapshot median "
        f"{medians['snapshot']:.3f} s, --code live {medians['live']:.3f} s; extra {extra:.3f} s "
        f"(target <= 1.5 s), ratio {medians['snapshot'] / medians['live']:.2f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--jobs", type=int, nargs="+", default=[8, 100])
    parser.add_argument("--only", choices=("snapshot",), help="only the code snapshot's cost")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-chain-"))
    recipe = work / "bench.sub"
    recipe.write_text(RECIPE)
    env = {
        **os.environ,
        "ORCH_HOME": str(work / "home"),
        "RUN": str(work),
        "RECIPE": str(recipe),
    }
    with bench_cluster(work) as conf:
        env["SLURM_CONF"] = conf
        if args.only == "snapshot":
            snapshot_cost(args.rounds, work, env)
            return
        medians = {n: submission_medians(n, args.rounds, work, recipe, env) for n in args.jobs}
        small, large = min(args.jobs), max(args.jobs)
        if large > small:
            marginal = {
                name: (medians[large][name] - medians[small][name]) / (large - small)
                for name in ("ours", "loop")
            }
            print(
                f"\nper extra job ({small} -> {large} jobs): auto_launch "
                f"{marginal['ours'] * 1000:.1f} ms, sbatch {marginal['loop'] * 1000:.1f} ms; "
                f"ratio {marginal['ours'] / marginal['loop']:.2f} (target <= 1.2)"
            )
        dry_run = [str(BIN / "auto_launch"), "--dry-run", "-n8", "--backend", "local"]
        fixed = {
            "with the plan check": [*dry_run, str(TRAINING_RECIPE)],
            "--no-plan-check": [*dry_run, "--no-plan-check", str(TRAINING_RECIPE)],
            "python -c pass (interpreter start)": [sys.executable, "-c", "pass"],
        }
        print(f"\nauto_launch --dry-run of {TRAINING_RECIPE.name}, local backend:")
        for label, argv in fixed.items():
            median = statistics.median(timed(argv, env) for _ in range(args.rounds))
            print(f"  {label}: median {median:.3f} s ({median / 0.3:.2f}x the 0.3 s target)")
        snapshot_cost(args.rounds, work, env)


if __name__ == "__main__":
    main()
