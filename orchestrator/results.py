"""What a run has to show, read from its run dir: training and validation rows, and evaluations.

The files are written by the trainer and ``python -m train.evaluate``; this module only reads them
and never imports either (nor torch):

- ``metrics.jsonl``: one JSON object per line. Training rows have ``loss``. Validation rows
  (rank 0) have ``val_loss``, ``val_tokens`` and ``val_split`` and no ``loss``; with several
  validation sets ``val_split`` is their names joined by commas, ``val_loss`` their pooled loss
  and ``val_loss/<set>`` each set's. Both carry
  ``step``, ``time`` and the job's context (``job_index``, ``seed``, ``chain_id``,
  ``slurm_job_id``). Each job's first step also writes one ``memory`` row (a list of every
  rank's measured ``params_bytes``, ``grads_bytes`` and ``optimizer_bytes``). Any other row
  with neither loss counts as a training row, as rows always did.
- ``eval/step_<N>/summary.json`` (``hypotheses.jsonl`` beside it): at least ``step``, ``split``,
  ``num_utterances``, ``wer`` and ``cer`` (fractions: 0.153 is 15.3 %), ``utterances_per_s``,
  ``layout``. The latest evaluation is the highest N whose summary parses and has a ``wer``.
  An evaluation of several test sets has the pooled figures there, each set's under ``sets``
  (``{name: {wer, cer, ...}}``), and a folder per set beside them.

Members of a sweep are ranked best first: by WER where they have one, else by validation loss,
members with neither last.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from contract.run_dir import (
    CHECKPOINTS_DIR,
    EVAL_DIR,
    METRICS_FILE,
    RECORD_KEYS,
    STEP_DIR,
    VAL_LOSS_PREFIX,
    not_writable,
    room_shortfall,
)
from orchestrator.manifest import Manifest

EVAL_SUMMARY = "summary.json"


def iter_metrics(run_dir: Path) -> Iterator[dict[str, Any]]:
    """The rows of ``run_dir/metrics.jsonl``; a last line still being written is left out."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            if not line.endswith("\n"):
                return
            if line.strip():
                yield json.loads(line)


def chain_rows(manifest: Manifest) -> list[dict[str, Any]]:
    """This chain's rows (a run dir continued by a later chain holds that chain's rows too)."""
    return [
        row
        for row in iter_metrics(Path(manifest.run_dir))
        if row.get("chain_id") in (manifest.chain_id, None)
    ]


def is_training_row(row: dict[str, Any]) -> bool:
    return "loss" in row or not ("val_loss" in row or any(key in row for key in RECORD_KEYS))


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def last_progress(manifest: Manifest) -> dict[int, tuple[int, float | None]]:
    """Per job index: the last training step the job logged and its loss."""
    progress: dict[int, tuple[int, float | None]] = {}
    for row in chain_rows(manifest):
        if is_training_row(row):
            progress[row.get("job_index", 0)] = (row["step"], row.get("loss"))
    return progress


def slow_ranks(manifest: Manifest) -> list[str]:
    """The ranks the trainer named slow (train/loop/straggler.py), a line each, as ``status``
    shows them: ``slow: node X, rank R, 1.7x median (job J, step S)``."""
    return [
        f"slow: node {row.get('straggler_node', '?')}, rank {row['straggler_rank']}, "
        f"{row.get('straggler_ratio', 0):.1f}x median (job {row.get('job_index', 0)}, "
        f"step {row['step']})"
        for row in chain_rows(manifest)
        if "straggler_rank" in row
    ]


@dataclass(frozen=True)
class Validation:
    """A validation loss the trainer logged (pooled), and each set's where there were several."""

    step: int
    val_loss: float
    split: str | None
    job_index: int | None
    sets: dict[str, float] = field(default_factory=dict)  # from ``val_loss/<set>``


def validations(rows: list[dict[str, Any]]) -> list[Validation]:
    """The rows that carry a numeric ``val_loss``, in the order they were logged."""
    return [
        Validation(
            row["step"],
            float(row["val_loss"]),
            row.get("val_split"),
            row.get("job_index"),
            {
                key.removeprefix(VAL_LOSS_PREFIX): float(value)
                for key, value in row.items()
                if key.startswith(VAL_LOSS_PREFIX) and is_number(value)
            },
        )
        for row in rows
        if is_number(row.get("val_loss"))
    ]


def latest_validation(run_dir: Path) -> Validation | None:
    """The run's last logged validation loss, whichever chain logged it."""
    found = validations(list(iter_metrics(run_dir)))
    return found[-1] if found else None


@dataclass(frozen=True)
class Evaluation:
    """One ``eval/step_<N>/summary.json``: what is needed to show and rank a run."""

    step: int
    split: str | None
    wer: float  # pooled over the sets where there were several
    cer: float | None
    num_utterances: int | None
    sets: dict[str, float] = field(default_factory=dict)  # each set's WER


def read_evaluation(path: Path, step: int) -> Evaluation | None:
    """The summary at ``path``, or None where it is missing, torn or has no numeric ``wer``."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not is_number(data.get("wer")):
        return None
    cer = data.get("cer")
    count = data.get("num_utterances")
    sets = data.get("sets")
    return Evaluation(
        step=step,
        split=data.get("split"),
        wer=float(data["wer"]),
        cer=float(cer) if is_number(cer) else None,
        num_utterances=count if isinstance(count, int) else None,
        sets={
            name: float(figures["wer"])
            for name, figures in (sets.items() if isinstance(sets, dict) else ())
            if isinstance(figures, dict) and is_number(figures.get("wer"))
        },
    )


def evaluations(run_dir: Path) -> list[Evaluation]:
    """Every evaluation whose summary parses, by step (one still being written is left out)."""
    found = []
    for folder in (Path(run_dir) / EVAL_DIR).glob("step_*"):
        if match := STEP_DIR.fullmatch(folder.name):
            evaluation = read_evaluation(folder / EVAL_SUMMARY, int(match.group(1)))
            if evaluation is not None:
                found.append(evaluation)
    return sorted(found, key=lambda evaluation: evaluation.step)


def latest_evaluation(run_dir: Path) -> Evaluation | None:
    """The evaluation of the highest step whose summary parses (a newer one may be unfinished)."""
    found = evaluations(run_dir)
    return found[-1] if found else None


@dataclass(frozen=True)
class RunResults:
    """A run's latest validation loss and latest evaluation, each None until there is one."""

    validation: Validation | None
    evaluation: Evaluation | None

    @classmethod
    def of(cls, run_dir: Path | str) -> RunResults:
        return cls(latest_validation(Path(run_dir)), latest_evaluation(Path(run_dir)))

    def rank_key(self) -> tuple[int, float]:
        """Sorts best first: by WER, then (runs without one) by val_loss, then the rest; a
        non-finite value (a diverged run) sorts after every finite one of its kind."""
        if self.evaluation is not None:
            return (0, finite_or_inf(self.evaluation.wer))
        if self.validation is not None:
            return (1, finite_or_inf(self.validation.val_loss))
        return (2, 0.0)

    def describe(self) -> str:
        """One line: ``val_loss 2.3456 at step 40 (dev); WER 15.30% at step 40 (dev, ...)``."""
        validation, evaluation = self.validation, self.evaluation
        parts = ["val_loss -", "WER -"]
        if validation is not None:
            where = f" ({validation.split})" if validation.split else ""
            parts[0] = f"val_loss {validation.val_loss:.4f} at step {validation.step}{where}"
        if evaluation is not None:
            details = [
                evaluation.split or "",
                f"CER {format_wer(evaluation.cer)}" if evaluation.cer is not None else "",
                f"{evaluation.num_utterances} utterances" if evaluation.num_utterances else "",
            ]
            where = ", ".join(item for item in details if item)
            parts[1] = f"WER {format_wer(evaluation.wer)} at step {evaluation.step}" + (
                f" ({where})" if where else ""
            )
        return "; ".join(parts)

    def per_set(self) -> dict[str, tuple[float | None, float | None]]:
        """Each named set's (latest val_loss, latest WER), None where it has none; empty
        unless training validated or the evaluation scored several sets."""
        validated = self.validation.sets if self.validation else {}
        scored = self.evaluation.sets if self.evaluation else {}
        return {name: (validated.get(name), scored.get(name)) for name in {**validated, **scored}}


def as_json(found: Validation | Evaluation | None) -> dict[str, Any] | None:
    """A result as ``status --json`` prints it: ``sets`` only where there were several sets,
    as in the files it was read from."""
    if found is None:
        return None
    record = asdict(found)
    if not record["sets"]:
        del record["sets"]
    return record


def finite_or_inf(value: float) -> float:
    return value if math.isfinite(value) else math.inf


def format_wer(value: float) -> str:
    """A WER or CER fraction as a percentage: 0.153 -> 15.30%."""
    return f"{value:.2%}"


def disk_problem(run_dir: Path) -> str | None:
    """Why the run dir's disk cannot take another checkpoint (read-only, or less room than the
    newest one took), in one line; None when it can. The trainer refuses to start on such a disk
    (exit 4), but its log sits on the same disk and may be cut: status says it from here."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    checkpoints = run_dir / CHECKPOINTS_DIR
    where = checkpoints if checkpoints.is_dir() else run_dir
    if not_writable(where):
        return f"the run dir's disk is read-only or not writable ({where}): nothing can be saved"
    shortfall = room_shortfall(checkpoints)
    if shortfall is None:
        return None
    free, needed, newest = shortfall
    return (
        f"the run dir's disk is full: {free / 2**20:.1f} MiB free under {where}, the last "
        f"checkpoint ({newest.name}) took {needed / 2**20:.1f} MiB; jobs end at their first save "
        "(exit 4, 'checkpoint ... not saved'): free space or move the run dir"
    )
