"""Recovery on the loopback cluster: seconds from a rank's SIGKILL to the next job's first step.

A 2-job chain of recipes/train_tiny_fsdp2.yaml (2 ranks, CPU) trains; once job 0 has logged a
few steps after its first checkpoint, one of its ranks is SIGKILLed. Timed from the kill:

- until SLURM records job 0 as ended (torchrun tears the other rank down, the step fails);
- until job 1 logs its first step (it starts on afterany, loads the last checkpoint, trains).

The steps lost are job 0's last logged step minus the step job 1 resumed from. Uses $SLURM_CONF
when set, else starts (and stops) a private cluster with `orchestrator cluster up`.

    python bench/bench_recovery.py [--corpus data/corpus] [--rounds 3]
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

import psutil
from loopback import bench_cluster  # bench/loopback.py, beside this script

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
INTERVAL = 5  # checkpoint.interval: the kill comes after the first checkpoint


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip() and '"loss"' in line]


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")


def rank_of(run_dir: Path) -> psutil.Process | None:
    """A training rank of this run (not torchrun): a `-m train` process naming the run dir."""
    for process in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if f"run_dir={run_dir}" not in cmdline or "torchrun" in cmdline:
            continue
        parent = process.parent()
        if (
            "-m train" in cmdline
            and parent is not None
            and "torchrun" in " ".join(parent.cmdline())
        ):
            return process
    return None


def job_state(job_id: str, env: dict) -> str:
    done = subprocess.run(
        ["scontrol", "show", "job", job_id], capture_output=True, text=True, env=env
    )
    for word in done.stdout.split():
        if word.startswith("JobState="):
            return word.split("=", 1)[1]
    return "GONE"


def one_round(work: Path, corpus: Path, env: dict, index: int) -> dict:
    run_dir = work / f"run{index}"
    launched = subprocess.run(
        [
            str(BIN / "auto_launch"),
            "-n2",
            "--json",
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

    wait_for(past_checkpoint, 300, "job 0 to pass a checkpoint")
    victim = wait_for(lambda: rank_of(run_dir), 30, "a rank of job 0")
    killed = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    wait_for(lambda: job_state(job0, env) not in ("RUNNING", "COMPLETING"), 120, "job 0 to end")
    ended = time.monotonic() - killed
    first = wait_for(
        lambda: next((r for r in rows(run_dir) if r.get("job_index") == 1), None),
        600,
        "job 1's first step",
    )
    resumed = time.monotonic() - killed
    last_step = max(r["step"] for r in rows(run_dir) if r.get("job_index", 0) == 0)
    subprocess.run([str(BIN / "orchestrator"), "cancel", str(run_dir)], env=env, check=False)
    return {
        "job_ended_s": ended,
        "next_first_step_s": resumed,
        "steps_lost": last_step - (first["step"] - 1),
    }


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
        results = []
        for index in range(args.rounds):
            result = one_round(work, args.corpus.resolve(), env, index)
            results.append(result)
            print(
                f"round {index + 1}/{args.rounds}: job 0 ended {result['job_ended_s']:.1f} s "
                f"after the kill; job 1's first step {result['next_first_step_s']:.1f} s after "
                f"it; {result['steps_lost']} step(s) lost (interval {INTERVAL})",
                flush=True,
            )
        ended = statistics.median(r["job_ended_s"] for r in results)
        resumed = statistics.median(r["next_first_step_s"] for r in results)
        print(
            f"\nmedian: SIGKILL -> job ended {ended:.1f} s; "
            f"-> next job's first step {resumed:.1f} s"
        )


if __name__ == "__main__":
    main()
