"""A user's own measured steps, as rows the planner's constants can be calibrated to
(``orchestrator plan --calibrate PATH``): a chain's run dir, whose metrics.jsonl holds each
job's ``run`` record (what ran: the trainer writes it at the job's first step) and its logged
tokens/s, or a table in measurements.csv's columns (what ``bash bench/gpu_check.sh`` writes).

A job's measured speed is the median of its logged tokens/s after its first logged line (which
holds compilation and the first batches), per GPU; it is priced as the plan check prices a
training config (``plan_check.request_and_layout``: ``data.max_duration`` of audio per rank
and microbatch).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from contract.gpus import gpu_preset
from contract.run_dir import METRICS_FILE, RUN_RECORD
from orchestrator.errors import UsageError
from orchestrator.planner.cluster import GIB
from orchestrator.planner.fit import PricedRow, prepare
from orchestrator.planner.measured import PRICED, Measurement, load
from orchestrator.planner.plan_check import Capacity, request_and_layout
from orchestrator.planner.search import timing_inputs


@dataclass
class Segment:
    """One job's (or in-job restart's) steps: what ran and the tokens/s it logged."""

    run: dict
    job: str
    speeds: list[float] = field(default_factory=list)


def segments(metrics: Path) -> list[Segment]:
    """The run records of a metrics.jsonl, each with the tokens/s its job logged after it."""
    found: list[Segment] = []
    current: dict[tuple, Segment] = {}
    with metrics.open(encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line a killed job left half-written
            key = (record.get("job_index"), record.get("slurm_job_id"))
            if RUN_RECORD in record:
                job = f"job {record.get('job_index')} (id {record.get('slurm_job_id')})"
                current[key] = Segment(record[RUN_RECORD], job)
                found.append(current[key])
            elif isinstance(record.get("tokens_per_s"), int | float) and key in current:
                current[key].speeds.append(float(record["tokens_per_s"]))
    return found


def row_of(segment: Segment, source: str) -> PricedRow:
    """The planner's row for one job: its config priced on the GPUs it ran on (ValueError:
    a job the step-time model cannot price, with why)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from train.config import TrainConfig

    run = segment.run
    if not run.get("gpu"):
        raise ValueError(
            "it ran on CPUs (or a GPU the planner's table lacks): the step-time model prices GPUs"
        )
    if len(segment.speeds) < 2:
        raise ValueError("it logged fewer than two lines of tokens/s (the first holds warm-up)")
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), run["config"]))
    except OmegaConfBaseException as error:
        raise ValueError(f"its config no longer reads as the trainer's: {error}") from error
    world, per_node = int(run["world"]), int(run["tasks_per_node"])
    gpu = gpu_preset(run["gpu"])
    capacity = Capacity(gpu.memory_gib * GIB, gpu.key, gpu)
    request, layout = request_and_layout(cfg, max(1, world // per_node), per_node, capacity)
    measured = statistics.median(segment.speeds[1:]) / world
    row = Measurement(
        source=f"{source} {segment.job}",
        date="",
        hardware=f"{world} x {gpu.key}",
        plan="",
        layout=layout.describe(),
        tokens_per_s_per_gpu=measured,
        peak_memory_gib=None,
        scope=PRICED,
    )
    return PricedRow(row, request, layout, timing_inputs(request, layout))


def run_dir_rows(run_dir: Path) -> tuple[list[PricedRow], list[str]]:
    """A run dir's jobs as rows, and a line for each job left out and why."""
    metrics = run_dir / METRICS_FILE
    if not metrics.is_file():
        raise UsageError(f"--calibrate {run_dir}: no {METRICS_FILE}: not a chain's run dir")
    rows, skipped = [], []
    for segment in segments(metrics):
        try:
            rows.append(row_of(segment, str(run_dir)))
        except ValueError as error:
            skipped.append(f"{run_dir} {segment.job}: left out: {error}")
    return rows, skipped


def calibration_rows(paths: list[Path]) -> tuple[list[PricedRow], list[str]]:
    """The measured rows of each path (a run dir, or a table in measurements.csv's columns),
    and the lines saying what was left out."""
    rows: list[PricedRow] = []
    skipped: list[str] = []
    for path in paths:
        if path.is_dir():
            found, left = run_dir_rows(path)
            rows += found
            skipped += left
            continue
        try:
            table = load(path)
        except (OSError, ValueError, KeyError) as error:
            raise UsageError(f"--calibrate {path}: {error}") from error
        rows += [prepare(row) for row in table if row.priced]
        skipped += [f"{path} {r.source}: left out: {r.scope}" for r in table if not r.priced]
    if not rows:
        raise UsageError(
            f"--calibrate: no measured GPU step to calibrate to in {', '.join(map(str, paths))}"
            + (f" ({skipped[0]})" if skipped else "")
        )
    return rows, skipped
