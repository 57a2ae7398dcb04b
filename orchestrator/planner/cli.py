"""``orchestrator plan``: the ranked layouts for a model, a batch and a cluster."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from orchestrator.errors import UsageError
from orchestrator.planner.arguments import layout_from, request_from
from orchestrator.planner.cluster import GIB
from orchestrator.planner.costs import HELD_OUT_ERROR
from orchestrator.planner.fit import Prediction, calibrate, price_row
from orchestrator.planner.measured import (
    MEMORY_BOUND,
    SPEED_BOUND,
    load,
)
from orchestrator.planner.past_runs import calibration_rows
from orchestrator.planner.ranking import sweep_figures
from orchestrator.planner.request import Estimate, PlanRequest, PlanResult
from orchestrator.planner.search import plan, price
from train.models.pretrained_parts import PARTS, part_of

MEMORY_KINDS = ("params", "grads", "optimizer", "activations", "comm_buffers", "allowance")


def estimate_json(result: Estimate, seconds: float) -> dict:
    layout = result.layout
    return {
        "layout": {
            **layout.degrees(),
            "microbatch": layout.microbatch,
            "microbatches": layout.microbatches,
            "ac": layout.ac,
        },
        "fits": result.fits,
        "memory_gib": {kind: value / GIB for kind, value in result.memory.items()},
        "step_time_s": result.step_time_s,
        "exposed_comm_s": result.times.get("exposed_comm"),
        "mfu": result.mfu,
        "reasoning": result.reasoning,
        "reason": result.reason or None,
        "overrides": layout.overrides(seconds),
    }


def result_json(result: PlanResult, shown: list[Estimate], elapsed: float) -> dict:
    request = result.request
    best = result.best
    return {
        "parameters": result.params,
        "trainable_parameters": result.trainable,
        "gpus": request.cluster.gpus,
        "gpu": request.cluster.gpu.key,
        "memory_per_gpu_gib": request.cluster.memory_bytes / GIB,
        "fits_one_gpu": result.fits_one_gpu,
        "checkpoint_bytes": result.checkpoint_bytes,
        "layouts_priced": len(result.estimates),
        "feasible": len(result.feasible),
        "best": None if best is None else estimate_json(best, request.seconds),
        "layouts": [estimate_json(item, request.seconds) for item in shown],
        "yaml": recipe_lines(request) if best else None,
        "seconds": elapsed,
        "runner_up_slower": spread(result),
        "constants": asdict(request.constants),
        "model_error": HELD_OUT_ERROR,
    }


def recipe_lines(request: PlanRequest) -> list[str]:
    cluster = request.cluster
    per_node = cluster.per_node
    return [
        "template: distributed",
        f"nodes: {cluster.nodes}",
        f"tasks_per_node: {per_node}",
        f"gpus_per_node: {per_node}",
        f"gpu: {cluster.gpu.key}",
    ]


def checkpoint_line(result: PlanResult) -> str:
    """``a checkpoint: 0.02 GiB (what trains, with its Adam moments; the frozen pretrained
    LLM by reference)``."""
    request = result.request
    parts = sorted({PARTS[part] for part in map(part_of, request.referenced) if part})
    held = f"; the frozen pretrained {' and '.join(parts)} by reference" if parts else ""
    return (
        f"a checkpoint: {result.checkpoint_bytes / GIB:.2f} GiB (weights, with Adam's moments "
        f"for what trains{held})"
    )


def print_result(result: PlanResult, shown: list[Estimate], elapsed: float) -> None:
    request = result.request
    cluster = request.cluster
    frozen = result.params - result.trainable
    training = f" ({result.trainable / 1e9:.2f}B train, the rest frozen)" if frozen else ""
    print(
        f"{result.params / 1e9:.2f}B parameters{training}; {cluster.gpus} x {cluster.gpu.key} "
        f"({cluster.nodes} node(s) of {cluster.per_node}, {cluster.memory_bytes / GIB:.0f} GiB "
        f"each); {request.global_batch} sequences of {request.seconds:g} s audio + "
        f"{request.tokens} tokens per step"
    )
    print(checkpoint_line(result))
    print(
        f"{len(result.estimates)} layouts priced in {elapsed * 1000:.0f} ms, "
        f"{len(result.feasible)} fit"
    )
    header = ["#", "layout", "GiB/GPU", "params", "grads", "optim", "act", "comm", "step s", "MFU"]
    rows = []
    for rank, item in enumerate(shown, 1):
        memory = item.memory
        rows.append(
            [
                str(rank) if item.fits else "-",
                item.layout.describe(),
                f"{memory['total'] / GIB:.1f}",
                *(f"{memory[kind] / GIB:.1f}" for kind in MEMORY_KINDS[:5]),
                f"{item.step_time_s:.2f}",
                f"{100 * item.mfu:.0f}%",
            ]
        )
    widths = [max(len(row[col]) for row in [header, *rows]) for col in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    for item in shown:
        if not item.fits:
            print(f"  does not fit: {item.layout.describe()}: {item.reason}")
    best = result.best
    if best is None:
        return
    line = spread_line(result)
    if line:
        print(line)
    print(f"best: {best.reasoning}")
    print("as Hydra overrides:")
    print("  " + " ".join(best.layout.overrides(request.seconds)))
    print("as a YAML recipe:")
    for line in recipe_lines(request):
        print(f"  {line}")


def spread(result: PlanResult) -> float | None:
    """How much slower the runner-up is predicted than the first choice (None: one layout)."""
    feasible = result.feasible
    if len(feasible) < 2:
        return None
    return feasible[1].step_time_s / feasible[0].step_time_s - 1


def spread_line(result: PlanResult) -> str:
    """How sure the first choice is: the predicted gap to the runner-up against the model's
    error on held-out measured runs (costs.HELD_OUT_ERROR)."""
    gap = spread(result)
    if gap is None:
        return ""
    error = f"{HELD_OUT_ERROR:.0%} between layouts of held-out measured sweeps"
    if abs(gap) < HELD_OUT_ERROR:
        verdict = f"within the model's error ({error}): either may measure faster"
    else:
        verdict = f"beyond the model's error ({error})"
    return f"spread: the runner-up is predicted {gap:+.1%} against the first choice, {verdict}"


def cmd_plan(args: argparse.Namespace) -> int:
    if args.measured is not None:
        return print_measured(Path(args.measured))
    request = request_from(args)
    calibration = None
    if args.calibrate:
        rows, skipped = calibration_rows(args.calibrate)
        for line in skipped:
            print(line, file=sys.stderr)
        calibration = calibrate(rows)
        request = replace(request, constants=calibration.constants)
        if not args.json:
            print(calibration.line())
    if args.layout:
        try:
            result = price(request, layout_from(args.layout, request))
        except ValueError as error:
            raise UsageError(f"--layout: {error}") from error
        if args.json:
            print(json.dumps(result_json(result, result.estimates, 0.0)))
        else:
            print_result(result, result.estimates, 0.0)
        check_fits(result)
        return 0
    started = time.perf_counter()
    result = plan(request)
    elapsed = time.perf_counter() - started
    shown = result.feasible[: max(0, args.top)]
    if args.all:
        shown += [item for item in result.estimates if not item.fits]
    if args.json:
        print(json.dumps(result_json(result, shown, elapsed)))
    else:
        print_result(result, shown, elapsed)
    check_fits(result)
    return 0


def check_fits(result: PlanResult) -> None:
    """No layout fits: a request nothing can serve is bad input (exit 2), said on one line with
    why the leanest layout does not fit, after the table (or JSON) that shows them all."""
    if result.best is not None:
        return
    cluster = result.request.cluster
    what = f"{cluster.gpus} x {cluster.gpu.key} ({cluster.memory_bytes / GIB:.0f} GiB each)"
    if not result.estimates:
        raise UsageError(f"no layout of the model runs on {what}; try another number of GPUs")
    leanest = result.estimates[0]  # those that do not fit come leanest first
    which = "the leanest, " if len(result.estimates) > 1 else ""
    raise UsageError(
        f"no layout fits {what}: {which}{leanest.layout.describe()}, {leanest.reason}; use "
        "more GPUs, a GPU with more memory, or a smaller batch"
    )


def print_measured(path: Path) -> int:
    """Predicted against measured, one markdown row per measurement, then each sweep's ranking
    figures (orchestrator/planner/ranking.py); 1 when a priced row the constants were fitted
    to is outside the bounds (held-out rows are reported, not bounded)."""
    try:
        rows = load(path)
    except (OSError, ValueError, KeyError) as error:
        raise UsageError(f"--measured {path}: {error}") from error
    print(
        "| source | configuration | layout | measured tok/s/GPU | predicted | error "
        "| measured GiB | predicted | error |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    outside = 0
    sweeps: dict[str, list[Prediction]] = {}
    for row in rows:
        if not row.priced:
            print(
                f"| {row.source} | `{row.plan}` | {row.layout} | {row.tokens_per_s_per_gpu:,.0f} "
                f"| {row.scope} | | {row.peak_memory_gib or ''} | | |"
            )
            continue
        p = price_row(row)
        if row.sweep:
            sweeps.setdefault(row.sweep, []).append(p)
        memory = "| |"
        if row.peak_memory_gib is not None:
            memory = f"| {p.memory_gib:.1f} | {p.memory_error:+.1%} |"
            outside += not row.held_out and abs(p.memory_error) > MEMORY_BOUND
        outside += not row.held_out and abs(p.speed_error) > SPEED_BOUND
        print(
            f"| {row.source} | `{row.plan}` | {row.layout} | {row.tokens_per_s_per_gpu:,.0f} "
            f"| {p.tokens_per_s:,.0f} | {p.speed_error:+.1%} | {row.peak_memory_gib or ''} {memory}"
        )
    bounds = f"{SPEED_BOUND:.0%} on speed, {MEMORY_BOUND:.0%} on memory"
    print(f"{outside} figure(s) outside the bounds ({bounds}; held-out rows are not bounded)")
    if sweeps:
        print()
        print("| sweep | part | layouts | rank correlation | first choice / best | worst error |")
        print("| --- | --- | ---: | ---: | ---: | ---: |")
        for name, priced in sweeps.items():
            if len(priced) < 2:
                continue  # one layout: nothing to rank
            figures = sweep_figures(
                name,
                priced[0].row.held_out,
                [p.row.tokens_per_s_per_gpu for p in priced],
                [p.tokens_per_s for p in priced],
            )
            print(figures.line())
    return 1 if outside else 0
