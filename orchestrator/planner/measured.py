"""Measured training speeds and memory, published or our own, priced by the planner.

Each row of ``measurements.csv`` (beside this file) is one measured configuration written the
way a user asks the planner about it: ``plan`` holds the arguments of ``orchestrator plan``
(model, sequence, global batch, GPUs) and ``layout`` the layout that ran, so that pricing a row
is running the planner on exactly what was measured. ``scope`` is ``priced`` for the rows the
planner can express and ``out: <why>`` for the others (float8 linears, async TP), which stay in
the table, listed with their reason, instead of being dropped. ``sweep`` names the rows of one
model on one cluster at one GPU count measured at several layouts, whose ranking the planner
must get right (orchestrator/planner/ranking.py); ``split`` says whether the step-time
constants were fitted to the row (``fit``, the default) or it is held out of every fit and only
reported (``held_out``). ``bench/gpu_check.py`` writes
its measured rows in the same columns, so our own GPU runs join the published ones.
"""

from __future__ import annotations

import csv
import shlex
from dataclasses import dataclass
from pathlib import Path

from train.parallel.dims import DEGREES

TABLE = Path(__file__).with_name("measurements.csv")
COLUMNS = (
    "source",  # where the figure was published, or the script that measured it
    "date",
    "hardware",  # the GPUs as measured (memory, power limit, interconnect)
    "plan",  # orchestrator plan's arguments for the configuration
    "layout",  # the layout that ran: degrees, microbatches, ac (parse_layout)
    "tokens_per_s_per_gpu",
    "peak_memory_gib",  # as published (empty: not published)
    "scope",  # priced, or "out: <why the planner cannot express it>"
    "sweep",  # the layouts of one model, cluster and GPU count compared (empty: none)
    "split",  # fit (empty: fit) or held_out
)
OPTIONAL_COLUMNS = ("sweep", "split")  # a table written before they existed has neither
PRICED = "priced"
FIT, HELD_OUT = "fit", "held_out"
SPEED_BOUND = 0.20  # predicted tokens/s per GPU within 20% of the measurement
MEMORY_BOUND = 0.15  # predicted peak memory within 15% where it was published
LAYOUT_KEYS = (*DEGREES, "microbatches", "ac")


@dataclass(frozen=True)
class Measurement:
    source: str
    date: str
    hardware: str
    plan: str
    layout: str
    tokens_per_s_per_gpu: float
    peak_memory_gib: float | None
    scope: str
    sweep: str = ""
    split: str = FIT

    @property
    def priced(self) -> bool:
        return self.scope == PRICED

    @property
    def held_out(self) -> bool:
        return self.split == HELD_OUT

    @property
    def plan_args(self) -> list[str]:
        return shlex.split(self.plan)


def parse_layout(text: str) -> dict[str, int | str]:
    """``"dp_shard=8 tp=2 microbatches=1 ac=selective"`` as a dict (degrees left out are 1)."""
    fields: dict[str, int | str] = {key: 1 for key in LAYOUT_KEYS if key != "ac"}
    fields["ac"] = "none"
    for item in text.split():
        key, sep, value = item.partition("=")
        if not sep or key not in LAYOUT_KEYS:
            raise ValueError(
                f"layout {text!r}: {item!r} is not one of {', '.join(k + '=' for k in LAYOUT_KEYS)}"
            )
        fields[key] = value if key == "ac" else int(value)
    return fields


def row_of(record: dict[str, str]) -> Measurement:
    memory = record["peak_memory_gib"].strip()
    return Measurement(
        source=record["source"],
        date=record["date"],
        hardware=record["hardware"],
        plan=record["plan"],
        layout=record["layout"],
        tokens_per_s_per_gpu=float(record["tokens_per_s_per_gpu"]),
        peak_memory_gib=float(memory) if memory else None,
        scope=record["scope"],
        sweep=(record.get("sweep") or "").strip(),
        split=(record.get("split") or "").strip() or FIT,
    )


def load(path: Path = TABLE) -> list[Measurement]:
    with path.open(newline="") as f:
        reader = csv.DictReader(row for row in f if not row.startswith("#"))
        missing = set(COLUMNS) - set(reader.fieldnames or ()) - set(OPTIONAL_COLUMNS)
        if missing:
            raise ValueError(f"{path}: missing columns {', '.join(sorted(missing))}")
        rows = [row_of(record) for record in reader]
    for row in rows:
        if row.split not in (FIT, HELD_OUT):
            raise ValueError(f"{path}: split {row.split!r} of {row.source!r}: give fit or held_out")
    return rows


def append(path: Path, rows: list[dict]) -> None:
    """Adds rows (dicts with ``COLUMNS``) to a table, writing its header when it is new."""
    fresh = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        if fresh:
            writer.writeheader()
        writer.writerows(rows)
