"""W&B offline runs read back with wandb's own reader, in an environment of the test's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

WANDB = [sys.executable, "-m", "wandb"]
# The test session's WANDB_MODE: an offline run costs ~4 CPU-s of a training's start and end
# (wandb-core and its files), half of a tiny run's own. The tests of W&B (test_metrics, test_plot,
# test_data_resume, test_preemption) run it offline through chains, resumes and preemption: with
# WANDB_OFFLINE among a run's overrides, or in ``base_env``, which drops the session's setting.
WANDB_MODE = "disabled"
WANDB_OFFLINE = "wandb.mode=offline"
ORCH_KEYS = ("ORCH_CHAIN_ID", "ORCH_SWEEP_ID", "ORCH_JOB_INDEX", "ORCH_SEED", "SLURM_JOB_ID")


def base_env(tmp: Path) -> dict[str, str]:
    """The test's environment with every wandb directory under ``tmp`` and no W&B settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k not in ORCH_KEYS}
    for name in ("DIR", "CACHE_DIR", "CONFIG_DIR", "DATA_DIR", "ARTIFACT_DIR"):
        path = tmp / "wandb_home" / name.lower()
        path.mkdir(parents=True, exist_ok=True)
        env[f"WANDB_{name}"] = str(path)
    env["OMP_NUM_THREADS"] = "1"
    return env


def wandb_records(run_file: Path, tmp: Path) -> list[dict]:
    """The records of one offline .wandb file, decoded by wandb's own reader."""
    done = subprocess.run(
        [*WANDB, "leet", "inspect", "--json", str(run_file)],
        env={**base_env(tmp), "WANDB_MODE": "offline"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def of_type(records: list[dict], kind: str) -> list[dict]:
    return [r[kind] for r in records if r["type"] == kind]
