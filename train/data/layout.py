"""What a saved data position depends on, and what a job does when that changed.

A checkpoint keeps each data-parallel rank's position as batch counts per stream
(``train.data.loader.DataPosition``). The counts mean the same place in the data only under the same
*data layout*: the data-parallel size (each rank keeps every ``dp_size``-th batch), the sources
and their weights, ``max_duration``, the buckets, the streams a rank reads (Shar's
dataloader workers), and how a step's examples are dealt to the ranks (``data.balance``).
Tensor-, context- and pipeline-parallel peers read their data-parallel rank's stream, so their
degrees are not part of it. Applied under another layout, the counts
continue some stream, but not the one an uninterrupted run would have read: data is skipped or
read twice, silently.

So the trainer records the layout beside the position, and a job resumed with the same seed
(a job with a new seed starts a new order anyway) under another layout does what
``data.on_layout_change`` says:

- ``refuse`` (the default): one ``error:`` line naming each change, before anything starts;
- ``restart_epoch``: the next epoch from its beginning, in its own order (each epoch is shuffled
  from the seed and its number): the rest of the interrupted epoch is not read, nothing is read
  twice within an epoch; the log and metrics.jsonl say so;
- ``continue``: the saved counts as they are (the behaviour before the layout was recorded),
  with a warning line.

Torch-free: the trainer's preflight (``train.parallel.layout``) compares layouts before any process
group.
"""

from __future__ import annotations

from typing import Any

from train.config import (
    BALANCE_FLOPS,
    BALANCE_SECONDS,
    BUFFER_SIZE,
    CONTINUE,
    RESTART_EPOCH,
    TrainConfig,
    balance_mode,
)
from train.data.sources import Source, read_sources

DATA_LAYOUT = "data_layout"  # its key in the checkpoint's trainer state


def num_streams(shar: bool, num_workers: int) -> int:
    """How many samplers feed one rank: one per worker for Shar, else one."""
    return num_workers if shar and num_workers > 0 else 1


def data_layout(cfg: TrainConfig, dp_size: int, read: list[Source] | None = None) -> dict[str, Any]:
    """The layout a data position of ``cfg``'s training data depends on (JSON); ``read``: the
    sources of data.input_cfg where the caller has them already (reading a NeMo list again
    would count its manifests' lines again)."""
    data = cfg.data
    if data.input_cfg is not None:
        if read is None:
            read = read_sources(data.input_cfg, "data.input_cfg")
        sources = [
            {
                "name": source.name,
                "kind": source.kind,
                "paths": [str(path) for path in source.paths],
                "weight": round(source.weight, 12),
            }
            for source in read
        ]
        streams = 1  # a mixture is drawn in the training process
    else:
        sources = [{"corpus": data.corpus, "split": data.split, "shar": data.shar}]
        streams = num_streams(data.shar, data.num_workers)
    balance = balance_mode(cfg)
    return {
        "dp_size": dp_size,
        "sources": sources,
        "max_duration": data.max_duration,
        "buckets": data.buckets,
        "buffer_size": data.buffer_size,
        "streams": streams,
        "balance": balance,
        "balance_window": data.balance_window if balance == BALANCE_FLOPS else None,
    }


# A field a checkpoint saved before it was recorded had this value.
SAVED_BEFORE = {"buffer_size": BUFFER_SIZE, "balance": BALANCE_SECONDS, "balance_window": None}
# What each field is called in the error line.
FIELD_NAMES = {
    "dp_size": "data-parallel size",
    "sources": "sources",
    "max_duration": "data.max_duration",
    "buckets": "data.buckets",
    "buffer_size": "data.buffer_size",
    "streams": "streams per rank (data.num_workers with Shar)",
    "balance": "data.balance",
    "balance_window": "data.balance_window",
}


def layout_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Each field that differs, as ``name was -> is`` (sources: only that they differ)."""
    changes = []
    for field, name in FIELD_NAMES.items():
        before, after = saved.get(field, SAVED_BEFORE.get(field)), now.get(field)
        if before == after:
            continue
        if field == "sources":
            changes.append("the sources or their weights")
        else:
            changes.append(f"{name} {before} -> {after}")
    return changes


def refusal(checkpoint: str, changes: list[str]) -> str:
    """The one line that refuses a changed layout, naming the changes and the choices."""
    return (
        f"data: {checkpoint} saved its data position under another data layout "
        f"({'; '.join(changes)}); resumed with the same seed, its batch counts would skip or "
        "repeat data. Resume with the layout it was saved with, or choose: "
        f"data.on_layout_change={RESTART_EPOCH} (start the next epoch from its beginning) or "
        f"data.on_layout_change={CONTINUE} (apply the saved counts as they are)"
    )
