"""The planner against measured steps: each row of a table of measurements priced as
``orchestrator plan`` prices it, and the step-time constants (``costs.StepConstants``) fitted to
the rows held in the fit, so that the held-out rows judge a model that never saw them.

``python -m orchestrator.planner.fit`` refits the constants on measurements.csv's fit rows and
prints them with the error on each part; ``costs.FITTED`` holds the result.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace

from orchestrator.errors import UsageError
from orchestrator.planner.activations import Microbatch
from orchestrator.planner.arguments import add_plan_parser, layout_from, request_from
from orchestrator.planner.cluster import GIB
from orchestrator.planner.costs import FITTED, StepConstants
from orchestrator.planner.measured import Measurement, load
from orchestrator.planner.request import Estimate, Layout, PlanRequest
from orchestrator.planner.search import price, timing_inputs
from orchestrator.planner.speed import step_time


@dataclass(frozen=True)
class Prediction:
    """The planner's figures for one measured row."""

    row: Measurement
    tokens_per_s: float  # per GPU
    memory_gib: float  # the busiest rank's total
    estimate: Estimate

    @property
    def speed_error(self) -> float:
        return self.tokens_per_s / self.row.tokens_per_s_per_gpu - 1

    @property
    def memory_error(self) -> float:
        if self.row.peak_memory_gib is None:
            return 0.0
        return self.memory_gib / self.row.peak_memory_gib - 1


@dataclass(frozen=True)
class PricedRow:
    """A measured row as the planner reads it: its request and layout, parsed once, and what
    its step time depends on beyond the constants."""

    row: Measurement
    request: PlanRequest
    layout: Layout
    timing: tuple  # search.timing_inputs

    @property
    def positions(self) -> int:
        request = self.request
        return Microbatch(1, request.frames, request.tokens).decoder_positions(request.model, 1)

    def tokens_per_s(self, constants: StepConstants = FITTED) -> float:
        """Predicted tokens/s per GPU under ``constants``."""
        request = replace(self.request, constants=constants)
        step = step_time(request, self.layout, *self.timing)["step"]
        return request.global_batch * self.positions / step / request.cluster.gpus


def prepare(row: Measurement) -> PricedRow:
    """A row's plan arguments and layout as the planner's request and layout."""
    parser = argparse.ArgumentParser(prog="orchestrator", exit_on_error=False)
    add_plan_parser(parser.add_subparsers())
    try:
        args = parser.parse_args(["plan", *row.plan_args])
    except (argparse.ArgumentError, SystemExit) as error:
        raise UsageError(f"measurement {row.plan!r}: not orchestrator plan's arguments") from error
    request = request_from(args)
    layout = layout_from(row.layout, request)
    return PricedRow(row, request, layout, timing_inputs(request, layout))


def price_row(row: Measurement, constants: StepConstants = FITTED) -> Prediction:
    """The planner's figures for a measured configuration: its plan arguments and layout."""
    priced = prepare(row)
    item = price(replace(priced.request, constants=constants), priced.layout).estimates[0]
    return Prediction(row, priced.tokens_per_s(constants), item.memory["total"] / GIB, item)


def rms_log_error(rows: list[PricedRow], constants: StepConstants) -> float:
    """The root mean square of log(predicted / measured) tokens/s over ``rows``."""
    errors = [math.log(r.tokens_per_s(constants) / r.row.tokens_per_s_per_gpu) for r in rows]
    return math.sqrt(sum(e * e for e in errors) / len(errors))


def sweep_error(rows: list[PricedRow], constants: StepConstants) -> float:
    """How far apart the model puts two layouts of one sweep against their measurements: the
    root mean square of each row's log error less its sweep's mean (what ordering layouts
    depends on; an offset common to a sweep's rows, its framework's, does not count), over
    the sweeps of two rows or more."""
    sweeps: dict[str, list[float]] = {}
    for r in rows:
        if r.row.sweep:
            error = math.log(r.tokens_per_s(constants) / r.row.tokens_per_s_per_gpu)
            sweeps.setdefault(r.row.sweep, []).append(error)
    residuals = []
    for errors in sweeps.values():
        if len(errors) > 1:
            mean = sum(errors) / len(errors)
            residuals += [e - mean for e in errors]
    if not residuals:
        raise ValueError("no sweep of two rows or more")
    return math.sqrt(sum(e * e for e in residuals) / len(residuals))


# Each fitted constant's grid: the fit searches these values, one constant at a time.
GRID = {
    "step_efficiency": [round(0.60 + 0.005 * i, 3) for i in range(71)],
    "microbatch_half_tokens": [25.0 * i for i in range(81)],
    "overlap_exponent": [1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 20.0, 50.0],
    "pipeline_imbalance": [0.0, 0.25, 0.5, 0.75, 1.0],
}


def fit(
    rows: list[PricedRow], start: StepConstants = FITTED, names: tuple[str, ...] = tuple(GRID)
) -> StepConstants:
    """The constants on ``GRID`` that minimise ``rms_log_error`` over ``rows``, by coordinate
    descent from ``start`` (each of ``names`` in turn at its best value, until none moves; the
    others stay at ``start``'s)."""
    if not rows:
        raise ValueError("no measured rows to fit the step-time constants to")
    best, loss = start, rms_log_error(rows, start)
    moved = True
    while moved:
        moved = False
        for name in names:
            for value in GRID[name]:
                candidate = replace(best, **{name: value})
                candidate_loss = rms_log_error(rows, candidate)
                if candidate_loss < loss - 1e-12:
                    best, loss, moved = candidate, candidate_loss, True
    return best


# Fewer measured steps than this calibrate the step efficiency alone: one or two rows cannot tell
# a microbatch's cost from the collectives' overlap.
ROWS_FOR_EVERY_CONSTANT = 3


@dataclass(frozen=True)
class Calibration:
    """The constants a user's own measured steps give, and their error before and after."""

    constants: StepConstants
    rows: int
    error_before: float  # RMS of log(predicted / measured) under FITTED
    error_after: float

    def line(self) -> str:
        before, after = math.expm1(self.error_before), math.expm1(self.error_after)
        return (
            f"calibrated on {self.rows} measured run(s) of yours: {self.constants.line()} "
            f"(published fit: {FITTED.line()}); their error {before:.1%} -> {after:.1%} RMS "
            "on tokens/s"
        )


def calibrate(rows: list[PricedRow], start: StepConstants = FITTED) -> Calibration:
    """The constants fitted to a user's measured steps, from the published fit: every constant
    from ``ROWS_FOR_EVERY_CONSTANT`` rows, the step efficiency alone from fewer."""
    names = tuple(GRID) if len(rows) >= ROWS_FOR_EVERY_CONSTANT else ("step_efficiency",)
    fitted = fit(rows, start, names)
    return Calibration(fitted, len(rows), rms_log_error(rows, start), rms_log_error(rows, fitted))


def fit_rows(rows: list[Measurement]) -> list[PricedRow]:
    """The priced rows held in the fit."""
    return [prepare(row) for row in rows if row.priced and not row.held_out]


def main() -> None:
    rows = load()
    fitting = fit_rows(rows)
    held_out = [prepare(row) for row in rows if row.priced and row.held_out]
    fitted = fit(fitting)
    print(f"fitted on {len(fitting)} rows: {fitted.line()}")
    print(f"costs.FITTED:           {FITTED.line()}")
    for label, part in (("fit", fitting), ("held out", held_out)):
        if part:
            error = rms_log_error(part, fitted)
            within = math.expm1(sweep_error(part, fitted))
            print(
                f"{label}: {len(part)} rows, RMS error {math.expm1(error):.1%} on tokens/s, "
                f"{within:.1%} between layouts of one sweep"
            )


if __name__ == "__main__":
    main()
