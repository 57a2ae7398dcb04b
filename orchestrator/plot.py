"""``orchestrator plot``: loss and throughput of a chain, or of a sweep's chains, as one PNG.

Reading and drawing are split: ``plot_data`` turns the chains' ``metrics.jsonl`` into plain series
(steps, losses, tokens/s, the jobs each series is made of, validation losses, pooled and per
validation set, the run's evaluations, pooled and per test set), which tests check against the
files; ``figure_of`` only draws them, as a figure whose axes tests read back, and ``draw`` writes
it. matplotlib is imported inside the drawing functions, so the other commands never pay for it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

SET_MARKERS = ("^", "v", "D", "P", "X", "*", "<", ">")  # one per named set; pooled: o and s
WER_COLOR = "C3"  # one chain's WER: a colour its loss (C0) never has
LABEL_ROW = 0.1  # of the loss axes' height: one chain's row of job labels, at the top


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


def plain_log_labels(axes: Axes) -> None:
    """Label the log-scaled y axis in plain numbers (0.5, 3, 20), where matplotlib writes
    5x10^0 once the axis spans less than a decade. Which ticks get a label stays matplotlib's
    choice."""
    from matplotlib.ticker import LogFormatter

    class PlainLogFormatter(LogFormatter):
        def __call__(self, x: float, pos: int | None = None) -> str:
            return f"{x:g}" if super().__call__(x, pos) else ""

    axes.yaxis.set_major_formatter(PlainLogFormatter())
    axes.yaxis.set_minor_formatter(PlainLogFormatter())


def leave_top(axes: Axes, fraction: float) -> None:
    """Raise the top of the y axis so the data fill its lower ``1 - fraction`` (in the axis's
    own scale, log or linear): the job labels drawn in that top band cover no curve."""
    scale = axes.yaxis.get_transform()
    bottom, top = scale.transform(axes.get_ylim())
    raised = bottom + (top - bottom) / (1 - fraction)
    axes.set_ylim(top=scale.inverted().transform([raised])[0])


def figure_of(data: PlotData) -> Figure:
    """Loss and tokens/s against step, job boundaries dashed, each job's index and seed in a
    band at the top of the loss axes that no curve enters; validation losses as dotted points
    on the loss axes; each evaluation's WER as a square on a WER axis of its own at the right,
    from 0, every line in the legend, the WER line's label with the latest WER. One chain's WER
    has a colour of its own; in a sweep each member keeps its colour for all its lines. Where
    there are several validation or test sets, each set gets a line of its own (its own marker)
    beside the pooled one. The loss axis is logarithmic, labelled in plain numbers."""
    from matplotlib.figure import Figure  # the Agg canvas: no display, no pyplot state

    figure = Figure(figsize=(10, 7), layout="constrained")
    loss_axes, speed_axes = figure.subplots(2, 1, sharex=True)
    colors = [f"C{i % 10}" for i in range(len(data.series))]
    names = sorted({name for s in data.series for name in [*s.val_sets, *s.wer_sets]})
    markers = {name: SET_MARKERS[i % len(SET_MARKERS)] for i, name in enumerate(names)}
    one_chain = len(data.series) == 1
    wer_axes = None
    if any(series.evaluated for series in data.series):
        wer_axes = loss_axes.twinx()
        axis_color = WER_COLOR if one_chain else "black"
        wer_axes.set_ylabel("WER %", color=axis_color)
        wer_axes.tick_params(axis="y", colors=axis_color)
    for row, (series, color) in enumerate(zip(data.series, colors, strict=True)):
        wer_color = WER_COLOR if one_chain else color
        loss_axes.plot(series.steps, series.losses, color=color, label=f"{series.label} loss")
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
                color=wer_color,
                linestyle="-.",
                marker="s",
                markersize=6,
                label=series.legend_label,
            )
        for name, points in series.wer_sets.items():
            wer_axes.plot(
                points.steps,
                [100 * wer for wer in points.values],
                color=wer_color,
                linestyle="-.",
                marker=markers[name],
                markersize=6,
                label=f"{series.label} WER {name}",
            )
        speed_axes.plot(series.steps, series.tokens_per_s, color=color, label=series.label)
        for x in series.boundaries:
            for axes in (loss_axes, speed_axes):
                axes.axvline(x, color=color, linestyle="--", linewidth=0.8, alpha=0.7)
        for job in series.jobs:
            loss_axes.annotate(
                f"job {job.job_index}\nseed {job.seed}",
                xy=(job.first_step, 1 - LABEL_ROW * row),
                xycoords=("data", "axes fraction"),
                xytext=(3, -3),
                textcoords="offset points",
                va="top",
                fontsize=7,
                color=color,
            )
    loss_axes.set_ylabel("loss")
    loss_axes.set_yscale("log")
    plain_log_labels(loss_axes)
    band = LABEL_ROW * len(data.series)
    leave_top(loss_axes, band)
    speed_axes.set_ylabel("tokens/s")
    speed_axes.set_xlabel("step")
    loss_axes.set_title(data.title)
    handles, labels = loss_axes.get_legend_handles_labels()
    legend_axes = loss_axes
    if wer_axes is not None:
        wer_axes.set_ylim(bottom=0)
        leave_top(wer_axes, band)
        wer_handles, wer_labels = wer_axes.get_legend_handles_labels()
        handles, labels = handles + wer_handles, labels + wer_labels
        legend_axes = wer_axes  # drawn above the loss axes: the WER points do not cover it
    legend_axes.legend(handles, labels, loc="lower left", fontsize=8)
    return figure


def draw(data: PlotData, out: Path) -> Path:
    """Write ``figure_of(data)`` to ``out`` as a PNG."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure_of(data).savefig(out, dpi=100)
    return out
