"""How well the planner ranks layouts: the figures of measured sweeps (several layouts of one
model on one cluster at one GPU count, ``sweep`` in measurements.csv), priced one by one.

A user runs the layout the planner ranks first, so what counts is the order, not the absolute
speed: the rank correlation of predicted and measured tokens/s over a sweep's rows (Spearman's,
ties at their mean rank), and the measured speed of the layout the planner puts first as a
fraction of the best measured (1.0: it chose the fastest; 0.7: the user loses 30%).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def mean_ranks(values: Sequence[float]) -> list[float]:
    """Each value's rank (1 for the smallest), tied values sharing their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            ranks[order[position]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation of two equally long sequences; None for fewer than two
    values or a sequence whose values are all equal (no order to compare)."""
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} values against {len(ys)}")
    if len(xs) < 2:
        return None
    rx, ry = mean_ranks(xs), mean_ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        return None
    return sxy / math.sqrt(sxx * syy)


@dataclass(frozen=True)
class SweepFigures:
    """One sweep's figures: its rows, the rank correlation, and the first choice's measured
    speed against the best measured."""

    sweep: str
    held_out: bool
    rows: int
    correlation: float | None
    first_of_best: float
    worst_error: float  # the largest relative error on tokens/s of its rows, signed

    def line(self) -> str:
        rho = "-" if self.correlation is None else f"{self.correlation:.2f}"
        part = "held out" if self.held_out else "fit"
        return (
            f"| {self.sweep} | {part} | {self.rows} | {rho} | {self.first_of_best:.2f}x "
            f"| {self.worst_error:+.1%} |"
        )


def sweep_figures(
    sweep: str, held_out: bool, measured: Sequence[float], predicted: Sequence[float]
) -> SweepFigures:
    """The figures of one sweep from its rows' measured and predicted tokens/s per GPU."""
    if not measured or len(measured) != len(predicted):
        raise ValueError(f"sweep {sweep!r}: {len(measured)} measured, {len(predicted)} predicted")
    first = max(range(len(predicted)), key=predicted.__getitem__)
    errors = [p / m - 1 for m, p in zip(measured, predicted, strict=True)]
    return SweepFigures(
        sweep=sweep,
        held_out=held_out,
        rows=len(measured),
        correlation=spearman(predicted, measured),
        first_of_best=measured[first] / max(measured),
        worst_error=max(errors, key=abs),
    )
