"""Recovery on the loopback cluster: seconds from a rank's SIGKILL to the next training step.

A 2-job chain of recipes/train_tiny_fsdp2.yaml (2 ranks, CPU) trains; once job 0 has logged a
few steps after its first checkpoint, one of its ranks is SIGKILLed. Each round runs both
rungs of the recovery ladder, timed from the kill to the first step the training logs again:

- ``new job`` (``--restarts-in-job 0``, the baseline): job 0 ends (torchrun tears the other rank
  down, the step fails), job 1 starts on afterany, loads the last checkpoint and trains;
- ``in place`` (the default): job 0's batch script launches the training again in the same
  allocation, which loads the last checkpoint and trains.

The steps lost are the last step logged before the kill minus the step the training resumed
from. Uses $SLURM_CONF when set, else starts (and stops) a private cluster with
`orchestrator cluster up`.

    python -m bench.bench_recovery [--corpus data/corpus] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.loopback import bench_cluster
from tests.harness.training import training_rank, wait_until

REPO = Path(__file__).resolve().parents[1]

BIN = Path(sys.executable).parent
INTERVAL = 5  # checkpoint.interval: the kill comes after the first checkpoint


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip() and '"loss"' in line]


def job_state(job_id: str, env: dict) -> str:
    done = subprocess.run(
        ["scontrol", "show", "job", job_id], capture_output=True, text=True, env=env
    )
    for word in done.stdout.split():
        if word.startswith("JobState="):
            return word.split("=", 1)[1]
    return "GONE"


# The rungs: auto_launch's --restarts-in-job, and which metrics rows are the recovered training's.
RUNGS = {
    "new job": ("0", lambda row: row.get("job_index") == 1),
    "in place": ("1", lambda row: row.get("in_job_restart") == 1),
}


def one_round(work: Path, corpus: Path, env: dict, index: int, rung: str) -> dict:
    run_dir = work / f"run{index}-{rung.replace(' ', '_')}"
    restarts, recovered = RUNGS[rung]
    launched = subprocess.run(
        [
            str(BIN / "auto_launch"),
            "-n2",
            "--json",
            "--restarts-in-job",
            restarts,
            "--run-dir",
            str(run_dir),
            "recipes/train_tiny_fsdp2.yaml",
            "--",
            f"data.corpus={corpus}",
            "data.max_duration=8",
            "wandb.mode=offline",
            "train.max_steps=400",
            f"checkpoint.interval={INTERVAL}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    if launched.returncode != 0:
        raise SystemExit(f"auto_launch failed: {launched.stderr}")
    summary = json.loads(launched.stdout.strip().splitlines()[-1])
    job0 = str(summary["jobs"][0]["job_id"])

    def past_checkpoint() -> bool:
        if job_state(job0, env) not in ("PENDING", "CONFIGURING", "RUNNING"):
            raise SystemExit(f"job 0 ended before the kill: see {run_dir / 'logs'}")
        return len(rows(run_dir)) >= INTERVAL + 3

    wait_until(past_checkpoint, 300, "job 0 to pass a checkpoint")
    victim = wait_until(lambda: training_rank(run_dir), 30, "a rank of job 0")
    killed = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    first = wait_until(
        lambda: next((r for r in rows(run_dir) if recovered(r)), None),
        600,
        f"the first step after the kill ({rung})",
    )
    resumed = time.monotonic() - killed
    last_step = max(r["step"] for r in rows(run_dir) if not recovered(r))
    subprocess.run([str(BIN / "orchestrator"), "cancel", str(run_dir)], env=env, check=False)
    return {"first_step_s": resumed, "steps_lost": last_step - (first["step"] - 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=REPO / "data" / "corpus")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    env = {
        **os.environ,
        "ORCH_HOME": str(work / "home"),
        "WANDB_MODE": "offline",
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",  # the jobs' torchrun
    }
    with bench_cluster(work, nodes=1, cpus_per_node=2) as conf:
        env["SLURM_CONF"] = conf
        results: dict[str, list[dict]] = {rung: [] for rung in RUNGS}
        for index in range(args.rounds):
            for rung in RUNGS:  # alternating, so that both see the same load
                result = one_round(work, args.corpus.resolve(), env, index, rung)
                results[rung].append(result)
                print(
                    f"round {index + 1}/{args.rounds}, {rung}: first step "
                    f"{result['first_step_s']:.1f} s after the kill; {result['steps_lost']} "
                    f"step(s) lost (interval {INTERVAL})",
                    flush=True,
                )
        medians = {
            rung: statistics.median(r["first_step_s"] for r in rows)
            for rung, rows in results.items()
        }
        print("\n| rung | SIGKILL -> next training step, median s | ratio to a new job |")
        print("| --- | ---: | ---: |")
        for rung, median in medians.items():
            print(f"| {rung} | {median:.1f} | {median / medians['new job']:.2f} |")


if __name__ == "__main__":
    main()
