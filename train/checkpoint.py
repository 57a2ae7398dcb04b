"""Checkpoints that chain across jobs: DCP for the sharded state, written atomically.

Layout of ``run_dir/checkpoints``::

    step_<N>/                 one complete checkpoint
        .metadata, *.distcp   DCP: model, optimizer and LR scheduler state (one copy, any layout)
        rng/rank_<r>.pt       RNG states of global rank r (torch CPU, CUDA, numpy, python)
        state.json            {"step", "world_size", "trainer_state"}; readable without torch
        COMPLETE              the marker, written last
    .tmp-step_<N>-<unique>/   a save in progress, or one torn by a crash

Model and optimizer go through ``get_state_dict``/``set_state_dict``, which hand DCP DTensors
(FSDP2/TP/EP) under their global shapes with FQN keys, so the checkpoint holds one copy whatever
the data-parallel degree, and loads under another layout (DCP reshards) or into a plain
single-process model. Under pipeline parallelism a rank holds some of the parameters only; the
optimizer state is flattened to per-parameter keys (hyperparameters included), so every rank
saves and loads exactly its own parameters' entries whatever the stage split. Checkpoints
written before that (with the optimizer's param groups as lists) still load, under layouts
without pipeline parallelism. The LR scheduler is replicated on every rank; DCP keeps one copy.

``trainer_state`` is the trainer's small JSON dict (step, tokens seen, W&B run id, data
position, ...). It lives in ``state.json`` so that tools without torch can read where a run is.

RNG states are per rank and meaningless under another world size (rank r then plays another
part), so each rank writes its own file and, on load, restores its own only when the world size
is unchanged; otherwise nothing is restored and rank 0 says so once. Of CUDA only the current
device's generator is saved: reading every visible device would create a context on each.

Atomicity: every rank writes into the temporary directory; after a barrier rank 0 writes
``state.json`` and then the ``COMPLETE`` marker there, and renames the directory to ``step_<N>``.
The marker goes in before the rename, so a ``step_<N>`` directory is always whole; one without
the marker (copied or damaged by hand) is torn and skipped like leftover ``.tmp-*`` directories.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
STATE_FILE = "state.json"
RNG_DIR = "rng"
_STEP_RE = re.compile(r"step_(\d+)")
_TMP_RE = re.compile(r"\.tmp-step_(\d+)-.+")
FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True)
# Only list-style param groups (before pipelines) have this key: a flattened one ends in a
# hyperparameter's name.
LEGACY_OPTIMIZER_KEY = "optim.param_groups.0.params"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read; the message names its path."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast_from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (on NCCL, after ``torch.cuda.set_device``)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_file(directory: Path, rank: int) -> Path:
    return directory / RNG_DIR / f"rank_{rank:05d}.pt"


def _rng_state() -> dict[str, Any]:
    """This process's generator states, in types ``torch.load(weights_only=True)`` accepts."""
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": "MT19937",
            "state": {"key": np_state["key"].numpy().astype(np.uint32), "pos": np_state["pos"]},
            "has_gauss": np_state["has_gauss"],
            "gauss": np_state["gauss"],
        }
    )
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _flat_optimizer(path: Path) -> bool:
    """Whether the checkpoint at ``path`` keeps the optimizer state flattened by parameter."""
    try:
        keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"cannot load checkpoint {path}: unreadable metadata ({exc!r})"
        ) from None
    return LEGACY_OPTIMIZER_KEY not in keys


class CheckpointManager:
    """Saves and finds the checkpoints of one run directory (shared by every job of a chain)."""

    def __init__(self, run_dir: Path, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep} must be at least 1 (the checkpoint to resume from)")
        self.directory = Path(run_dir) / "checkpoints"
        self.keep = keep

    def _scan(self) -> tuple[dict[int, Path], list[tuple[int, Path]]]:
        """Complete checkpoints by step, and the torn entries (step dirs without marker, tmp)."""
        complete: dict[int, Path] = {}
        torn: list[tuple[int, Path]] = []
        if not self.directory.is_dir():
            return complete, torn
        for entry in sorted(self.directory.iterdir()):
            step_match = _STEP_RE.fullmatch(entry.name)
            tmp_match = _TMP_RE.fullmatch(entry.name)
            if step_match and (entry / MARKER).is_file():
                complete[int(step_match.group(1))] = entry
            elif step_match or tmp_match:
                torn.append((int((step_match or tmp_match).group(1)), entry))
        return complete, torn

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None; torn ones are skipped with a warning."""
        complete, torn = self._scan()
        if torn and _rank() == 0:
            log.warning(
                "skipping incomplete checkpoints (no %s marker): %s",
                MARKER,
                ", ".join(str(path) for _, path in torn),
            )
        return complete[max(complete)] if complete else None

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        trainer_state: dict,
    ) -> Path:
        """Write checkpoint ``step_<step>`` and return its path. Collective: every rank calls it.

        A step that already has a complete checkpoint is left as it is.
        """
        started = time.perf_counter()
        try:
            state_json = json.dumps(
                {"step": step, "world_size": _world_size(), "trainer_state": trainer_state},
                indent=1,
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"trainer_state must be JSON-serialisable: {exc}") from exc
        final = self.directory / f"step_{step}"
        tmp_name = None
        if _rank() == 0 and not (final / MARKER).is_file():
            tmp_name = f".tmp-step_{step}-{uuid.uuid4().hex[:12]}"
            (self.directory / tmp_name).mkdir(parents=True)
        tmp_name = _broadcast_from_rank0(tmp_name)
        if tmp_name is None:
            if _rank() == 0:
                log.info("checkpoint %s already exists: not saving step %d again", final, step)
            return final
        tmp = self.directory / tmp_name

        rng_file = _rng_file(tmp, _rank())
        rng_file.parent.mkdir(exist_ok=True)
        torch.save(_rng_state(), rng_file)
        model_state, optim_state = get_state_dict(model, optimizer, options=FLAT_OPTIMIZER)
        state = {"model": model_state, "optim": optim_state, "scheduler": scheduler.state_dict()}
        dcp.save(state, checkpoint_id=tmp)
        _barrier()
        if _rank() == 0:
            _write_durably(tmp / STATE_FILE, state_json)
            _write_durably(tmp / MARKER, f"{time.time()}\n")
            if final.exists():
                shutil.rmtree(final)  # torn: its step had no marker
            tmp.rename(final)
            _fsync_dir(self.directory)
            self._prune()
            log.info("saved checkpoint %s in %.2f s", final, time.perf_counter() - started)
        _barrier()
        return final

    def _prune(self) -> None:
        """Keep the newest ``keep`` complete checkpoints; drop torn entries not newer than those."""
        complete, torn = self._scan()
        newest = max(complete)
        doomed = [complete[s] for s in sorted(complete)[: -self.keep]]
        doomed += [path for s, path in torn if s <= newest]
        for path in doomed:
            shutil.rmtree(path)
        if doomed:
            log.info("removed old checkpoints: %s", ", ".join(p.name for p in doomed))

    def load(
        self,
        path: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    ) -> dict:
        """Restore ``path`` into the objects given and return its trainer_state. Collective.

        The model may use any parallel layout, or none. Pass ``optimizer=None`` and
        ``scheduler=None`` to load the weights alone (e.g. for evaluation).
        """
        started = time.perf_counter()
        path = Path(path)
        saved = self._read_state_file(path)
        optimizers = () if optimizer is None else optimizer
        options = FLAT_OPTIMIZER if optimizer is None or _flat_optimizer(path) else None
        model_state, optim_state = get_state_dict(model, optimizers, options=options)
        state: dict[str, Any] = {"model": model_state}
        if optimizer is not None:
            state["optim"] = optim_state
        if scheduler is not None:
            state["scheduler"] = scheduler.state_dict()
        try:
            dcp.load(state, checkpoint_id=path)
        except CheckpointException as exc:
            reason = next(iter(exc.failures.values()))[0]
            raise CheckpointError(f"cannot load checkpoint {path}: {reason}") from None
        set_state_dict(
            model,
            optimizers,
            model_state_dict=state["model"],
            optim_state_dict=state.get("optim", {}),
            options=options,
        )
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
        self._restore_rng(path, saved["world_size"])
        if _rank() == 0:
            log.info("loaded checkpoint %s in %.2f s", path, time.perf_counter() - started)
        return saved["trainer_state"]

    @staticmethod
    def _read_state_file(path: Path) -> dict:
        if not (path / MARKER).is_file():
            raise CheckpointError(
                f"cannot load checkpoint {path}: it is not a complete checkpoint (no {MARKER} "
                "marker); pass a path that latest() returns"
            )
        try:
            saved = json.loads((path / STATE_FILE).read_text())
            return {"world_size": int(saved["world_size"]), "trainer_state": saved["trainer_state"]}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(
                f"cannot load checkpoint {path}: unreadable {STATE_FILE} ({exc!r})"
            ) from None

    @staticmethod
    def _restore_rng(path: Path, saved_world_size: int) -> None:
        if saved_world_size != _world_size():
            if _rank() == 0:
                log.warning(
                    "checkpoint %s was saved by %d ranks, this job has %d: RNG states not restored",
                    path,
                    saved_world_size,
                    _world_size(),
                )
            return
        rng_file = _rng_file(path, _rank())
        try:
            state = torch.load(rng_file, weights_only=True)
        except (OSError, RuntimeError) as exc:
            raise CheckpointError(f"cannot load checkpoint {path}: {rng_file}: {exc}") from None
        _set_rng_state(state)
