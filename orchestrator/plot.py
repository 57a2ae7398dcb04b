"""``orchestrator plot``: loss and throughput of a chain, or of a sweep's chains, as one PNG.

Reading and drawing are split: ``plot_data`` turns the chains' ``metrics.jsonl`` into plain series
(steps, losses, tokens/s, the jobs each series is made of, validation losses, pooled and per
validation set, the run's evaluations, pooled and per test set), which tests check against the
files; ``draw`` only renders them. matplotlib is imported inside ``draw``, so the other
commands never pay for it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contract.run_dir import METRICS_FILE
from orchestrator.errors import UsageError
from orchestrator.manifest import (
    Manifest,
    find_manifests,
    sweep_index_path,
    sweep_labels,
    sweep_members,
)
from orchestrator.results import (
    Evaluation,
    Validation,
    chain_rows,
    evaluations,
    format_wer,
    is_number,
    is_training_row,
    validations,
)

SET_MARKERS = ("^", "v", "D", "P", "X", "*", "<", ">")  # one per named set; pooled: o and s


@dataclass(frozen=True)
class JobSpan:
    """The steps one job of a chain logged, and the seed it ran with."""

    job_index: int
    seed: int | None
    first_step: int
    last_step: int


@dataclass(frozen=True)
class SetSeries:
    """One named validation or test set's values (val_loss or WER) against step."""

    steps: list[int]
    values: list[float]


@dataclass(frozen=True)
class ChainSeries:
    label: str
    chain_id: str
    steps: list[int]
    losses: list[float]  # NaN where a step logged no (finite) loss
    tokens_per_s: list[float]
    jobs: list[JobSpan]
    val_steps: list[int]
    val_losses: list[float]  # pooled over the validation sets where there are several
    val_sets: dict[str, SetSeries]  # each validation set's val_loss
    evaluated: list[Evaluation]  # the run's evaluations, by step
    wer_sets: dict[str, SetSeries]  # each test set's WER

    @property
    def evaluation(self) -> Evaluation | None:
        """The run's latest."""
        return self.evaluated[-1] if self.evaluated else None

    @property
    def legend_label(self) -> str:
        """The label, with the run's latest WER where it has one."""
        if self.evaluation is None:
            return self.label
        wer = format_wer(self.evaluation.wer)
        return f"{self.label}: WER {wer} (step {self.evaluation.step})"

    @property
    def boundaries(self) -> list[float]:
        """Where one job hands over to the next: halfway between their steps."""
        return [
            (a.last_step + b.first_step) / 2 for a, b in zip(self.jobs, self.jobs[1:], strict=False)
        ]


@dataclass(frozen=True)
class PlotData:
    title: str
    series: list[ChainSeries]
    without_metrics: list[str]  # chain ids of sweep members that have logged nothing yet


def _number(value: Any) -> float:
    return float(value) if is_number(value) else math.nan


def job_spans(rows: list[dict[str, Any]]) -> list[JobSpan]:
    """Consecutive rows of one job make one span; a change of job_index starts the next."""
    spans: list[JobSpan] = []
    for row in rows:
        index = row.get("job_index", 0)
        if spans and spans[-1].job_index == index:
            spans[-1] = JobSpan(index, spans[-1].seed, spans[-1].first_step, row["step"])
        else:
            spans.append(JobSpan(index, row.get("seed"), row["step"], row["step"]))
    return spans


def by_set(points: Iterable[Validation | Evaluation]) -> dict[str, SetSeries]:
    """Each named set's series, from the points (validations or evaluations) of several sets."""
    found: dict[str, SetSeries] = {}
    for point in points:
        for name, number in point.sets.items():
            series = found.setdefault(name, SetSeries([], []))
            series.steps.append(point.step)
            series.values.append(number)
    return found


def chain_series(manifest: Manifest, label: str) -> ChainSeries | None:
    """The chain's series, or None when it has logged no row yet."""
    rows = chain_rows(manifest)
    if not rows:
        return None
    training = [row for row in rows if is_training_row(row)]
    validated = validations(rows)
    evaluated = evaluations(Path(manifest.run_dir))
    return ChainSeries(
        label=label,
        chain_id=manifest.chain_id,
        steps=[row["step"] for row in training],
        losses=[_number(row.get("loss")) for row in training],
        tokens_per_s=[_number(row.get("tokens_per_s")) for row in training],
        jobs=job_spans(training),
        val_steps=[point.step for point in validated],
        val_losses=[point.val_loss for point in validated],
        val_sets=by_set(validated),
        evaluated=evaluated,
        wer_sets=by_set(evaluated),
    )


def plot_data(name: str) -> PlotData:
    """Series for a chain id, run dir or sweep id; UsageError when nothing has been logged yet."""
    labels = sweep_labels(name)
    series: list[ChainSeries] = []
    without: list[str] = []
    manifests = find_manifests(name)
    for manifest in manifests:
        label = labels.get(manifest.chain_id, manifest.chain_id) if labels else manifest.chain_id
        found = chain_series(manifest, label)
        if found is None:
            without.append(manifest.chain_id)
        else:
            series.append(found)
    if not series:
        where = "its chains" if labels else manifests[0].run_dir
        raise UsageError(
            f"{name}: no metrics yet (no {METRICS_FILE} rows in {where}); "
            "plot again once the first job has logged a step"
        )
    title = f"sweep {name}" if labels else series[0].chain_id
    return PlotData(title=title, series=series, without_metrics=without)


def default_output(name: str) -> Path:
    """``$ORCH_HOME/sweeps/<id>.png`` for a sweep, ``<run dir>/plot.png`` for a chain."""
    if sweep_members(name) is not None:
        return sweep_index_path(name).with_suffix(".png")
    return Path(find_manifests(name)[0].run_dir) / "plot.png"


def draw(data: PlotData, out: Path) -> Path:
    """Render loss and tokens/s against step, job boundaries dashed, each job's seed named;
    validation losses as dotted points on the loss axes, each evaluation's WER as a square on a
    WER axis at the right, the latest WER in the legend. Where there are several validation or
    test sets, each set gets a line of its own (its own marker, the chain's colour) beside the
    pooled one. The loss axis is logarithmic."""
    from matplotlib.figure import Figure  # the Agg canvas: no display, no pyplot state

    figure = Figure(figsize=(10, 7), layout="constrained")
    loss_axes, speed_axes = figure.subplots(2, 1, sharex=True)
    colors = [f"C{i % 10}" for i in range(len(data.series))]
    names = sorted({name for s in data.series for name in [*s.val_sets, *s.wer_sets]})
    markers = {name: SET_MARKERS[i % len(SET_MARKERS)] for i, name in enumerate(names)}
    wer_axes = None
    if any(series.evaluated for series in data.series):
        wer_axes = loss_axes.twinx()
        wer_axes.set_ylabel("WER % (squares)")
    for row, (series, color) in enumerate(zip(data.series, colors, strict=True)):
        loss_axes.plot(series.steps, series.losses, color=color, label=series.legend_label)
        if series.val_steps:
            loss_axes.plot(
                series.val_steps,
                series.val_losses,
                color=color,
                linestyle=":",
                marker="o",
                markersize=4,
                label=f"{series.label} val_loss",
            )
        for name, points in series.val_sets.items():
            loss_axes.plot(
                points.steps,
                points.values,
                color=color,
                linestyle=":",
                marker=markers[name],
                markersize=4,
                label=f"{series.label} val_loss/{name}",
            )
        if wer_axes is not None and series.evaluated:
            wer_axes.plot(
                [evaluation.step for evaluation in series.evaluated],
                [100 * evaluation.wer for evaluation in series.evaluated],
                color=color,
                linestyle="-.",
                marker="s",
                markersize=5,
            )
        for name, points in series.wer_sets.items():
            wer_axes.plot(
                points.steps,
                [100 * wer for wer in points.values],
                color=color,
                linestyle="-.",
                marker=markers[name],
                markersize=5,
                label=f"{series.label} WER {name}",
            )
        speed_axes.plot(series.steps, series.tokens_per_s, color=color, label=series.label)
        for x in series.boundaries:
            for axes in (loss_axes, speed_axes):
                axes.axvline(x, color=color, linestyle="--", linewidth=0.8, alpha=0.7)
        for job in series.jobs:
            loss_axes.annotate(
                f"job {job.job_index}\nseed {job.seed}",
                xy=(job.first_step, 1 - 0.1 * row),
                xycoords=("data", "axes fraction"),
                xytext=(3, -3),
                textcoords="offset points",
                va="top",
                fontsize=7,
                color=color,
            )
    loss_axes.set_ylabel("loss")
    loss_axes.set_yscale("log")
    speed_axes.set_ylabel("tokens/s")
    speed_axes.set_xlabel("step")
    loss_axes.set_title(data.title)
    handles, labels = loss_axes.get_legend_handles_labels()
    if wer_axes is not None:  # the per-set WER lines are labelled on their own axes
        wer_handles, wer_labels = wer_axes.get_legend_handles_labels()
        handles, labels = handles + wer_handles, labels + wer_labels
    loss_axes.legend(handles, labels, loc="lower left", fontsize=8)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    return out
