"""When a training step reads back and writes a metrics line, and what the line holds.

A step syncs (reads its figures back: ``train.loop.step_tallies``) every ``train.sync_every`` steps
and at every log line; it logs every ``train.log_every`` steps and at the last. Rates (tokens/s,
step time, MFU) cover the steps since the previous line, their positions and FLOPs summed from
the sync steps between.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from contract import job_env
from contract.gpus import gpu_of_device
from contract.run_dir import job_start_path
from train.config import TrainConfig
from train.flops import PEAK_FLOPS_ENV, peak_flops
from train.loop.step_tallies import Synced
from train.memory import STATE_KINDS
from train.metrics import MetricsLogger, scrub_secrets
from train.models.compiled import graph_counts, recompiles
from train.parallel.distributed import say


def device_peak_flops(device: torch.device) -> float | None:
    """The device's datasheet bf16 peak (``ORCH_PEAK_FLOPS`` overrides); None on the CPU or an
    unknown GPU, which the log says once."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = peak_flops(name, os.environ)
    if peak is None:
        say(f"MFU not reported: no peak FLOP/s known for {name!r}; set {PEAK_FLOPS_ENV}")
    return peak


class StepLog:
    """The cadence of sync steps and metrics lines, and the rates since the last line."""

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        self.log_every, self.sync_every = cfg.train.log_every, cfg.train.sync_every
        self.max_steps, self.compiled = cfg.train.max_steps, cfg.compile
        self.device = device
        self.peak: float | None = None
        self.since = {"time": time.perf_counter(), "step": 0, "positions": 0.0, "flops": 0.0}

    def start(self, step: int) -> None:
        """Training starts (again) after ``step``: rates count from now."""
        self.peak = device_peak_flops(self.device)
        self.since.update(time=time.perf_counter(), step=step, positions=0.0, flops=0.0)

    def logs(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.max_steps

    def syncs(self, step: int) -> bool:
        return self.logs(step) or step % self.sync_every == 0

    def add(self, synced: Synced) -> None:
        """A sync step's positions and FLOPs, for the next line's rates."""
        self.since["positions"] += synced.positions
        self.since["flops"] += synced.flops

    def record(
        self, step: int, synced: Synced, lr: float, tokens_seen: int, nonfinite_steps: int
    ) -> dict[str, float]:
        """The metrics line of a log step (the data's cut counts are added by the caller)."""
        since, now = self.since, time.perf_counter()
        elapsed = max(now - since["time"], 1e-9)
        record = {
            "loss": synced.loss,
            "lr": lr,
            "grad_norm": synced.grad_norm,
            "tokens_per_s": since["positions"] / elapsed,
            "step_time_s": elapsed / (step - int(since["step"])),
            "tokens_seen": tokens_seen,
            "nonfinite_steps": nonfinite_steps,
        }
        if self.peak is not None:
            record["mfu"] = since["flops"] / (elapsed * self.peak * dist.get_world_size())
        if self.compiled:
            record["recompiles"] = recompiles(graph_counts())
        since.update(time=now, step=step, positions=0.0, flops=0.0)
        return record


def write_job_start(run_dir: Path, cfg: TrainConfig, device: torch.device) -> None:
    """What this job runs, for the planner (contract.run_dir.job_start_path): the resolved config
    (secrets scrubbed, as W&B gets it), the world, ranks per node and the GPU (None on a CPU or a
    GPU the table does not know), with the job's index and id as metrics.jsonl's rows carry
    them. Rank 0 writes it (replacing an in-job restart's earlier one); not collective."""
    if dist.get_rank() != 0:
        return
    world = dist.get_world_size()
    gpu = gpu_of_device(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    index, job_id = int(os.environ.get(job_env.JOB_INDEX, "0")), job_env.job_id(os.environ)
    record = {
        "job_index": index,
        "slurm_job_id": job_id,
        "config": scrub_secrets(asdict(cfg), os.environ.get("WANDB_API_KEY")),
        "world": world,
        "tasks_per_node": int(os.environ.get("LOCAL_WORLD_SIZE", world)),
        "gpu": None if gpu is None else gpu.key,
    }
    path = job_start_path(run_dir, str(index), job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, default=str) + "\n")
    tmp.replace(path)


def log_state_memory(
    metrics: MetricsLogger, step: int, rank: int, state_memory: dict[str, int] | None
) -> None:
    """Every rank's measured parameter, gradient and optimizer-state bytes: one ``memory``
    record (what ``orchestrator plan`` predicts) and one startup line. Collective."""
    gathered: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"rank": rank, **(state_memory or {})})
    metrics.write(step, {"memory": gathered})
    busiest = max(gathered, key=lambda entry: sum(entry[kind] for kind in STATE_KINDS))
    mib = ", ".join(f"{kind.split('_')[0]} {busiest[kind] / 2**20:.2f} MiB" for kind in STATE_KINDS)
    say(f"state memory of the busiest rank ({busiest['rank']}): {mib}")
