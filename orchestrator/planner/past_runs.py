"""A user's own measured steps, as rows the planner's constants can be calibrated to
(``orchestrator plan --calibrate PATH``): a chain's run dir, whose job_starts/ holds what each
job ran (the trainer writes it at the job's first step) and whose metrics.jsonl holds the
tokens/s it logged, or a table in measurements.csv's columns (what ``bash bench/gpu_check.sh``
writes).

A job's measured speed is the median of its logged tokens/s, each launch's first logged line
left out (it holds compilation and the first batches), per GPU; it is priced as the plan check
prices a training config (``plan_check.request_and_layout``: ``data.max_duration`` of audio
per rank and microbatch).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from contract.gpus import gpu_preset
from contract.run_dir import JOB_STARTS_DIR, METRICS_FILE
from orchestrator.errors import UsageError
from orchestrator.planner.cluster import GIB
from orchestrator.planner.fit import PricedRow, prepare
from orchestrator.planner.measured import PRICED, Measurement, load
from orchestrator.planner.plan_check import Capacity, request_and_layout
from orchestrator.planner.search import timing_inputs


@dataclass
class Segment:
    """One job: what ran, and the tokens/s it logged after each launch's first line."""

    run: dict
    job: str
    speeds: list[float] = field(default_factory=list)


def logged_speeds(metrics: Path) -> dict[tuple, list[float]]:
    """The tokens/s a metrics.jsonl logged, by job (index, id), each launch's first line (a
    job's, and an in-job restart's) left out."""
    launches: dict[tuple, list[float]] = {}
    with metrics.open(encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line a killed job left half-written
            if isinstance(record.get("tokens_per_s"), int | float):
                key = (record.get("job_index"), record.get("slurm_job_id"))
                launch = (*key, record.get("in_job_restart"))
                launches.setdefault(launch, []).append(float(record["tokens_per_s"]))
    speeds: dict[tuple, list[float]] = {}
    for (index, job_id, _), logged in launches.items():
        speeds.setdefault((index, job_id), []).extend(logged[1:])
    return speeds


def job_segments(run_dir: Path) -> list[Segment]:
    """Each job of a run dir that recorded what it ran, with the speeds it logged."""
    speeds = logged_speeds(run_dir / METRICS_FILE)
    found = []
    for path in sorted((run_dir / JOB_STARTS_DIR).glob("*.json")):
        try:
            run = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        key = (run.get("job_index"), run.get("slurm_job_id"))
        job = f"job {key[0]} (id {key[1] or 'local'})"
        found.append(Segment(run, job, speeds.get(key, [])))
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
    if not segment.speeds:
        raise ValueError("it logged no tokens/s after its first line (which holds warm-up)")
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), run["config"]))
    except OmegaConfBaseException as error:
        raise ValueError(f"its config no longer reads as the trainer's: {error}") from error
    world, per_node = int(run["world"]), int(run["tasks_per_node"])
    gpu = gpu_preset(run["gpu"])
    capacity = Capacity(gpu.memory_gib * GIB, gpu.key, gpu)
    request, layout = request_and_layout(cfg, max(1, world // per_node), per_node, capacity)
    measured = statistics.median(segment.speeds) / world
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
    if not (run_dir / METRICS_FILE).is_file():
        raise UsageError(f"--calibrate {run_dir}: no {METRICS_FILE}: not a chain's run dir")
    rows, skipped = [], []
    segments = job_segments(run_dir)
    if not segments:
        skipped.append(
            f"{run_dir}: no {JOB_STARTS_DIR}/: its jobs ran before the trainer recorded "
            "what each ran"
        )
    for segment in segments:
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
