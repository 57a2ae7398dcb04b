"""Checkpoints that chain across jobs: DCP for the sharded state, written atomically.

Layout of ``run_dir/checkpoints``::

    step_<N>/                 one complete checkpoint
        .metadata, *.distcp   DCP: model, optimizer and LR scheduler state (one copy, any layout)
        rng/rank_<r>.pt       RNG states of global rank r (torch CPU, CUDA, numpy, python)
        state.json            {"step", "world_size", "trainer_state"}; readable without torch
        COMPLETE              the marker, written last
    .tmp-step_<N>-<unique>/   a save in progress, or one torn by a crash (removed at start)
    .trash-<name>-<unique>/   a pruned checkpoint being deleted in the background
    step_<N>.broken-<unique>/ a complete checkpoint that failed to load, set aside for a look

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

Atomicity: every rank writes (and fsyncs) its files into the temporary directory; once every
rank's write has succeeded rank 0 writes ``state.json`` and then the ``COMPLETE`` marker there,
and renames the directory to ``step_<N>``. The marker goes in before the rename, so a
``step_<N>`` directory is always whole; one without the marker (copied or damaged by hand) is
torn and skipped like leftover ``.tmp-*`` directories, which are never loaded.

Asynchronous saves (``async_save``): while the loop waits, the state is copied into CPU buffers
allocated at the first save and reused by every later one (one flat buffer per dtype, pinned on
CUDA; a few ``_foreach_copy_`` calls instead of one copy per tensor). A background thread then
checks that copy for non-finite values, and DCP writes it (with nothing left to stage) over a
gloo group of its own (its collectives would otherwise interleave with the training loop's),
along with the RNG file. The save is finalized (marker and rename, as above) at a step boundary
where every rank agrees its write is done (``poll``), or before the next save or the end of the
job (``wait``): all ranks finalize at the same call, and a crash before that leaves only a
``.tmp-*`` directory. The buffers are only overwritten by the next save, after that finalize.

A save that fails (disk full, read-only, no permission) removes its temporary directory once
every rank has given up and raises ``CheckpointSaveError``: one line naming the problem, the
disk and its free space, the path and the checkpoint that is still intact. Parameters or
optimizer states that are not finite are never written (``NonFiniteState``: raised by ``save``,
or for an asynchronous save by the finalize, which removes the temporary directory instead of
marking it). Old checkpoints are pruned by renaming them to ``.trash-*`` and deleting those in a
background thread, so no rank waits for the deletion.

For tests only: with ``ORCH_TEST_CHECKPOINT_PAUSES`` (``PAUSE_ENV``) set to a directory, a test
arms a pause at step N by writing a number of seconds to ``DIR/step_N``. Rank 0 then pauses the
finalize of that step's save (sync or async) for that long, with every rank's files written and
no marker yet, after renaming the file to ``DIR/step_N.paused``, which then says where it paused:
the moment for the test to kill the job and tear the save. ``DIR/write_step_N`` instead pauses
an asynchronous save's background thread before DCP writes the staged copy, while training goes
on and changes the live weights: the staged copy must still be written. Each armed file pauses
one save (the next job's save of the same step goes through). Unset, it costs one environment
lookup per save.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import logging
import os
import random
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from contract.run_dir import (
    CHECKPOINTS_DIR,
    MARKER,
    STATE_FILE,
    TMP_DIR,
    room_shortfall,
    scan_checkpoints,
    step_name,
    tmp_step_name,
)
from train.models.init import canonical_name

log = logging.getLogger(__name__)

RNG_DIR = "rng"
_TRASH_PREFIX = ".trash-"
FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True)
# Only list-style param groups (before pipelines) have this key: a flattened one ends in a
# hyperparameter's name.
LEGACY_OPTIMIZER_KEY = "optim.param_groups.0.params"
# What a failed write means to the user, and what to do about it.
_DISK_PROBLEMS = {
    errno.ENOSPC: ("no space left on device", "free space or move the run dir"),
    errno.EDQUOT: ("disk quota exceeded", "free space or move the run dir"),
    errno.EROFS: ("read-only file system", "make it writable or move the run dir"),
    errno.EACCES: ("permission denied", "fix the permissions or move the run dir"),
    errno.EPERM: ("operation not permitted", "fix the permissions or move the run dir"),
}
_PROBE_BYTES = 1 << 16  # written and fsynced at start: a full or read-only disk refuses it
# Tests only (the module docstring): the directory of armed pauses, and what an armed file is
# renamed to when its pause begins.
PAUSE_ENV = "ORCH_TEST_CHECKPOINT_PAUSES"
PAUSED_SUFFIX = ".paused"
WRITE_PAUSE_PREFIX = "write_"  # + the step's name: a pause before an async save's DCP write


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read; the message names its path."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint that could not be written (disk full, read-only, ...): one line that names
    the problem, the disk, the path and the checkpoint still intact."""


class NonFiniteState(RuntimeError):
    """Parameters or optimizer states hold NaN or inf: nothing was saved."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _broadcast_from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (on NCCL, after ``torch.cuda.set_device``)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _first_of_ranks(value: Any) -> Any:
    """The first non-None ``value`` of the ranks, in rank order, on every rank (a collective
    that also makes every rank wait for the others)."""
    if not dist.is_initialized():
        return value
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return next((item for item in gathered if item is not None), None)


def _collective_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_ranks(flag: torch.Tensor) -> bool:
    """Whether ``flag`` (a 0-d bool tensor) holds on every rank: one all-reduce, one read."""
    value = flag.to(_collective_device(), torch.float32)
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


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


def _write_rng(directory: Path, state: dict[str, Any]) -> None:
    """This rank's RNG file, fsynced with its directory entry before any marker can follow."""
    path = _rng_file(directory, _rank())
    path.parent.mkdir(exist_ok=True)
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(path.parent)


def _saved_keys(path: Path) -> set[str]:
    """The keys of the checkpoint at ``path`` (``model.<name>``, ``optim.state.<name>.<field>``)."""
    try:
        return set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    except Exception as exc:  # a torn .metadata fails in pickle with any of several errors
        raise CheckpointError(
            f"cannot load checkpoint {path}: unreadable metadata ({exc!r})"
        ) from None


def _optimizer_param(key: str) -> str | None:
    """The parameter a flat optimizer key is about (``state.<name>.<field>``,
    ``param_groups.<name>.<field>``), else None."""
    for prefix in ("state.", "param_groups."):
        if key.startswith(prefix):
            return key[len(prefix) :].rsplit(".", 1)[0]
    return None


def _frozen_when_saved(optim_state: dict, saved: set[str]) -> set[str]:
    """The parameters that train now but were frozen when the checkpoint was saved (a
    ``model.freeze`` rule changed between jobs): their weights are in it, their optimizer state
    is not. Every other key is loaded as strictly as before."""
    with_state = {_optimizer_param(key[len("optim.") :]) for key in saved if key[:6] == "optim."}
    training = {_optimizer_param(key) for key in optim_state} - {None}
    return {n for n in training if n not in with_state and f"model.{n}" in saved}  # type: ignore[misc]


def _local_tensors(tree: dict, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """The floating-point tensors of a state dict as this rank holds them (DTensor shards)."""
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _local_tensors(value, f"{name}.")
        elif isinstance(value, torch.Tensor) and value.is_floating_point():
            local = value.to_local() if isinstance(value, DTensor) else value
            if local.numel():
                yield name, local


def _extremes(tensor: torch.Tensor) -> torch.Tensor:
    """Min and max (NaN if any element is NaN): finite exactly when every element is."""
    return torch.stack(torch.aminmax(tensor)).float()


def _squares_finite(tensors: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """Whether x.x is finite for every tensor (a 0-d bool on their device): one pass each (BLAS,
    ~2x faster than min/max on CPU). x.x is finite exactly when every x is, unless the values are
    so large that it overflows, so only a failure needs ``_local_nonfinite``."""
    squares = [torch.dot(t.reshape(-1), t.reshape(-1)).float() for _, t in tensors]
    if not squares:
        return torch.tensor(True, device="cpu")
    return torch.isfinite(torch.stack(squares)).all()


def _local_nonfinite(tensors: list[tuple[str, torch.Tensor]]) -> str | None:
    """The first of ``tensors`` with a NaN or inf element, named with this rank, or None."""
    local = next(
        (name for name, t in tensors if not torch.isfinite(_extremes(t)).all().item()), None
    )
    return None if local is None else f"{local} (rank {_rank()})"


def _first_nonfinite(state: dict) -> str | None:
    """The name of a non-finite tensor of ``state`` on any rank (all ranks agree), or None.
    Costs one x.x per tensor and one all-reduced flag on the device (``_squares_finite``)."""
    tensors = list(_local_tensors(state))
    if _all_ranks(_squares_finite(tensors)):
        return None
    return _first_of_ranks(_local_nonfinite(tensors))


def _staged_nonfinite(state: dict, group: dist.ProcessGroup | None) -> tuple[str | None, bool]:
    """The check of a staged CPU copy, in the background write: this rank's first non-finite
    tensor (or None), and whether every rank's copy is finite (one all-reduce over ``group``, a
    CPU group; None: this process alone)."""
    tensors = list(_local_tensors(state))
    bad = None if _squares_finite(tensors).item() else _local_nonfinite(tensors)
    finite = torch.tensor(float(bad is None), device="cpu")
    if group is not None:
        dist.all_reduce(finite, op=dist.ReduceOp.MIN, group=group)
    return bad, bool(finite.item())


def _tensor_leaves(tree: Any) -> Iterator[torch.Tensor]:
    """The tensors of a state dict, in the order ``_with_tensors`` replaces them."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensor_leaves(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _tensor_leaves(value)


def _with_tensors(tree: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """``tree`` with its tensors replaced by ``tensors`` (in ``_tensor_leaves`` order) and its
    other leaves copied: a snapshot that the loop's next steps cannot change."""
    if isinstance(tree, (int, float, str, type(None))):  # most leaves (hyperparameters)
        return tree
    if isinstance(tree, torch.Tensor):
        return next(tensors)
    if isinstance(tree, dict):
        return {key: _with_tensors(value, tensors) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_with_tensors(value, tensors) for value in tree]
    if isinstance(tree, tuple):
        return tuple(_with_tensors(value, tensors) for value in tree)
    return copy.deepcopy(tree)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class _Staging:
    """CPU copies of a state dict's tensors for asynchronous saves, in one flat buffer per dtype
    (pinned when the state is on CUDA), allocated at the first save and reused by the next ones.

    A save then costs one ``_foreach_copy_`` per device and dtype (DCP's own staging deep-copies
    the state dict, ~1,000 tensors one by one), and DCP gets a state dict that is already on the
    CPU. DTensors keep their mesh and placements: the staged
    one wraps the CPU copy of the local shard under the original's spec (``from_local`` would
    move it back to the mesh's device). Not thread-safe; the caller must not stage again while
    a write of the previous staged dict is in flight."""

    def __init__(self) -> None:
        self._layout: list[tuple[torch.dtype, torch.Size]] = []
        self._views: list[torch.Tensor] = []

    def _allocate(self, local: list[torch.Tensor]) -> None:
        """One buffer per dtype for ``local`` (the tensors as this rank holds them), and a view
        into it for each."""
        offsets: list[int] = []
        sizes: dict[torch.dtype, int] = {}
        for t in local:
            offsets.append(sizes.get(t.dtype, 0))
            sizes[t.dtype] = offsets[-1] + t.numel()
        pin = any(t.is_cuda for t in local)
        buffers = {
            dtype: torch.empty(size, dtype=dtype, device="cpu", pin_memory=pin)
            for dtype, size in sizes.items()
        }
        self._views = [
            buffers[t.dtype][offset : offset + t.numel()].view(t.shape)
            for t, offset in zip(local, offsets, strict=True)
        ]
        self._layout = [(t.dtype, t.shape) for t in local]

    @torch.no_grad()
    def stage(self, state: dict) -> dict:
        """A copy of ``state`` whose tensors are views into the reused CPU buffers, complete
        when this returns (on CUDA, after one stream sync)."""
        tensors = list(_tensor_leaves(state))
        local = [_local(t) for t in tensors]
        if [(t.dtype, t.shape) for t in local] != self._layout:
            self._allocate(local)
        groups: dict[tuple[torch.device, torch.dtype], tuple[list, list]] = {}
        for view, t in zip(self._views, local, strict=True):
            targets, sources = groups.setdefault((t.device, t.dtype), ([], []))
            targets.append(view)
            sources.append(t)
        cuda = any(device.type == "cuda" for device, _ in groups)
        for targets, sources in groups.values():
            torch._foreach_copy_(targets, sources, non_blocking=cuda)
        if cuda:
            torch.cuda.current_stream().synchronize()
        staged = (
            DTensor(view, t._spec, requires_grad=False) if isinstance(t, DTensor) else view
            for view, t in zip(self._views, tensors, strict=True)
        )
        return _with_tensors(state, staged)


def _existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def _mount_point(path: Path) -> Path:
    path = _existing(path).resolve()
    while not os.path.ismount(path):
        path = path.parent
    return path


def _size(nbytes: float) -> str:
    """``0 B``, ``12.3 KiB``, ``4.8 MiB``, ``1.2 GiB``."""
    if nbytes < 1024:
        return f"{nbytes:.0f} B"
    for unit in ("KiB", "MiB"):
        nbytes /= 1024
        if nbytes < 1024:
            return f"{nbytes:.1f} {unit}"
    return f"{nbytes / 1024:.1f} GiB"


def _disk(path: Path) -> str:
    """The file system that holds ``path``, with its free space: ``/mnt/runs (0 B free)``."""
    free = shutil.disk_usage(_existing(path)).free
    return f"{_mount_point(path)} ({_size(free)} free)"


def _find_os_error(exc: BaseException | None) -> OSError | None:
    """The OSError behind a failed write: itself, its cause, or one a DCP rank reported."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError):
            return exc
        if isinstance(exc, CheckpointException):
            for failure, _ in exc.failures.values():
                found = _find_os_error(failure)
                if found is not None:
                    return found
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def _disk_errno(where: Path) -> int | None:
    """The errno a write under ``where`` would meet now: read-only, not writable, or full."""
    directory = _existing(where)
    stats = os.statvfs(directory)
    if stats.f_flag & os.ST_RDONLY:
        return errno.EROFS
    if not os.access(directory, os.W_OK):
        return errno.EACCES
    if stats.f_bavail * stats.f_frsize < _PROBE_BYTES:
        return errno.ENOSPC
    return None


def _describe(exc: BaseException, where: Path) -> dict:
    """A failed write under ``where``, small enough to gather: its errno, the path and a
    one-line reason. torch.save's zip writer turns a failed write into a RuntimeError without
    the errno ("unexpected pos"), so the disk itself is asked when no OSError is found."""
    os_error = _find_os_error(exc)
    if os_error is not None:
        return {
            "errno": os_error.errno,
            "path": None if os_error.filename is None else str(os_error.filename),
            "reason": os_error.strerror or str(os_error),
        }
    reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else repr(exc)
    return {"errno": _disk_errno(where), "path": None, "reason": reason}


def _pause_if_armed(arm: Path, tmp: Path, what: str) -> None:
    """The test hook (``PAUSE_ENV``): if ``arm`` exists, disarm it by renaming it to
    ``<arm>.paused`` (holding the line below, so a test that sees the file can read it whole),
    then sleep its number of seconds."""
    try:
        seconds = float(arm.read_text())
    except FileNotFoundError:
        return
    line = f"checkpoint write paused at {tmp} for {seconds:g} s: {what} ({PAUSE_ENV})"
    _write_durably(arm, f"{line}\n")
    arm.rename(arm.with_name(f"{arm.name}{PAUSED_SUFFIX}"))
    log.warning(line)
    time.sleep(seconds)


def _remove_all(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


@dataclass
class _Written:
    """What a background write of one rank found (``_Pending.future``'s result)."""

    nonfinite: str | None = None  # this rank's first non-finite tensor: nothing was written
    error: dict | None = None  # a failed write (``_describe``)


@dataclass
class _Pending:
    """A save whose files are being written into ``tmp``, finalized by ``_finalize``."""

    step: int
    tmp: Path
    state_json: str
    started: float
    error: dict | None = None  # a failure of this rank's own writes (the RNG file)
    future: Future[_Written] | None = None  # the background write (async_save)


class CheckpointManager:
    """Saves and finds the checkpoints of one run directory (shared by every job of a chain).

    ``async_save``: ``save`` returns once the state is copied to CPU memory; the files are
    written in the background and the checkpoint is finalized by ``poll``, ``wait`` or the next
    ``save``, any of which raises NonFiniteState if the copy was not finite. Every rank must make
    the same calls at the same steps (they are collectives).
    """

    def __init__(
        self,
        run_dir: Path,
        keep: int = 3,
        async_save: bool = False,
        timeout: timedelta | None = None,
    ) -> None:
        """``timeout``: of the background saves' gloo group (the trainer gives every process
        group the same, ``train.watchdog.process_group_timeout``); None: gloo's default."""
        if keep < 1:
            raise ValueError(f"keep={keep} must be at least 1 (the checkpoint to resume from)")
        self.directory = Path(run_dir) / CHECKPOINTS_DIR
        self.keep = keep
        self._pending: _Pending | None = None
        self._deleting: list[threading.Thread] = []
        self._staging: _Staging | None = None
        self._group: dist.ProcessGroup | None = None
        if async_save:
            # One save is in flight at most: the next one first finalizes it, then restages.
            self._staging = _Staging()
            if dist.is_initialized():
                self._group = dist.new_group(backend="gloo", timeout=timeout)

    @property
    def pending(self) -> bool:
        """Whether a save is still being written (async_save) and not yet finalized."""
        return self._pending is not None

    def _scan(self) -> tuple[dict[int, Path], list[tuple[int, Path]]]:
        """Complete checkpoints by step, and the torn entries (step dirs without marker, tmp)."""
        return scan_checkpoints(self.directory)

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

    # start of a job -----------------------------------------------------------------------------

    def remove_leftovers(self) -> None:
        """Rank 0 deletes ``.tmp-*`` saves torn by a crash and ``.trash-*`` left by pruning:
        they hold a checkpoint's worth of disk each. Call at a job's start only: a running
        job's save in progress is a ``.tmp-*`` too."""
        if _rank() != 0 or not self.directory.is_dir():
            return
        leftovers = [
            entry
            for entry in sorted(self.directory.iterdir())
            if TMP_DIR.fullmatch(entry.name) or entry.name.startswith(_TRASH_PREFIX)
        ]
        if leftovers:
            log.warning("removing what earlier jobs left: %s", ", ".join(p.name for p in leftovers))
            _remove_all(leftovers)

    def check_room(self) -> None:
        """Raise CheckpointSaveError (every rank, one line) if a checkpoint cannot be saved: the
        directory is not writable or has less room than the newest checkpoint took. Collective."""
        problem = self._room_problem() if _rank() == 0 else None
        problem = _broadcast_from_rank0(problem)
        if problem is not None:
            raise CheckpointSaveError(problem)

    def _room_problem(self) -> str | None:
        """Rank 0: why a checkpoint cannot be saved now (one line), or None."""
        probe = self.directory / f".probe-{uuid.uuid4().hex[:12]}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(probe, "wb") as f:
                f.write(b"\0" * _PROBE_BYTES)
                f.flush()
                os.fsync(f.fileno())
            probe.unlink()
        except OSError as exc:
            failure = _describe(exc, self.directory)
            with contextlib.suppress(OSError):  # a read-only disk refuses even this
                probe.unlink(missing_ok=True)
            problem, fix = _DISK_PROBLEMS.get(failure["errno"], (failure["reason"], None))
            return (
                f"checkpoints cannot be saved: {problem} on {_disk(self.directory)} writing "
                f"{failure['path'] or probe}; {fix or 'check the disk or move the run dir'}"
            )
        shortfall = room_shortfall(self.directory)
        if shortfall is None:
            return None
        free, needed, newest = shortfall
        return (
            f"checkpoints cannot be saved: {_size(free)} free on {_mount_point(self.directory)}, "
            f"the last checkpoint {newest.name} took {_size(needed)}, in {self.directory}; "
            "free space or move the run dir"
        )

    # saving -----------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        trainer_state: dict,
    ) -> Path:
        """Write checkpoint ``step_<step>`` and return its path. Collective: every rank calls it.

        Synchronous unless ``async_save``: then the checkpoint is complete once finalized by
        ``poll``, ``wait`` or the next ``save`` (which first finalizes the one in flight). A step
        that already has a complete checkpoint is left as it is. Raises NonFiniteState, having
        written nothing, if a parameter or optimizer state is not finite (asynchronous saves:
        the finalize raises it), and CheckpointSaveError if the files cannot be written.
        """
        started = time.perf_counter()
        try:
            state_json = json.dumps(
                {"step": step, "world_size": _world_size(), "trainer_state": trainer_state},
                indent=1,
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"trainer_state must be JSON-serialisable: {exc}") from exc
        self.wait()
        model_state, optim_state = get_state_dict(model, optimizer, options=FLAT_OPTIMIZER)
        state = {"model": model_state, "optim": optim_state, "scheduler": scheduler.state_dict()}
        if self._staging is None:  # an asynchronous save checks its copy in the background
            bad = _first_nonfinite(state)
            if bad is not None:
                raise NonFiniteState(self._refusal(step, bad))
        final = self.directory / step_name(step)
        made: str | dict | None = None
        if _rank() == 0 and not (final / MARKER).is_file():
            made = tmp_step_name(step, uuid.uuid4().hex[:12])
            try:
                (self.directory / made).mkdir(parents=True)
            except OSError as exc:
                made = _describe(exc, self.directory)
        made = _broadcast_from_rank0(made)
        if made is None:
            if _rank() == 0:
                log.info("checkpoint %s already exists: not saving step %d again", final, step)
            return final
        if isinstance(made, dict):
            raise CheckpointSaveError(self._failure_line(step, made, self.directory))
        pending = _Pending(step, self.directory / made, state_json, started)
        if self._staging is not None:
            staged = self._staging.stage(state)
            writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-write")
            pending.future = writer.submit(self._write, step, pending.tmp, staged, _rng_state())
            writer.shutdown(wait=False)  # its thread ends with this write
            self._pending = pending
            if _rank() == 0:
                log.info(
                    "checkpoint %s staged in %.2f s, written in the background",
                    final.name,
                    time.perf_counter() - started,
                )
            return final
        try:
            _write_rng(pending.tmp, _rng_state())
        except OSError as exc:
            pending.error = _describe(exc, pending.tmp)
        try:
            dcp.save(state, checkpoint_id=pending.tmp)
        except (CheckpointException, OSError) as exc:
            pending.error = pending.error or _describe(exc, pending.tmp)
        self._finalize(pending)
        return final

    def _write(self, step: int, tmp: Path, staged: dict, rng: dict[str, Any]) -> _Written:
        """The background write of an asynchronous save: the RNG file, then, if every rank's
        staged copy is finite, DCP's files (a collective over this manager's gloo group)."""
        written = _Written()
        try:
            _write_rng(tmp, rng)
        except OSError as exc:
            written.error = _describe(exc, tmp)
        written.nonfinite, finite = _staged_nonfinite(staged, self._group)
        if not finite:
            return written
        if PAUSE_ENV in os.environ and _rank() == 0:  # the other ranks wait in dcp.save
            _pause_if_armed(
                Path(os.environ[PAUSE_ENV]) / f"{WRITE_PAUSE_PREFIX}{step_name(step)}",
                tmp,
                "its staged copy not yet written, training going on",
            )
        # The copy is already on the host: no side stream to copy it ahead with (DCP's default
        # on a CUDA machine), whose syncs CUDA's sync debug mode would count against the step
        # that runs meanwhile.
        writer = FileSystemWriter(tmp, per_thread_copy_ahead=0)
        try:
            dcp.save(staged, checkpoint_id=tmp, storage_writer=writer, process_group=self._group)
        except (CheckpointException, OSError) as exc:
            written.error = written.error or _describe(exc, tmp)
        return written

    def poll(self) -> None:
        """Finalize the save in flight if every rank's write is done; else leave it running.
        Collective when a save is in flight (call it on every rank at the same steps)."""
        pending = self._pending
        if pending is None:
            return
        done = pending.future is None or pending.future.done()
        if _all_ranks(torch.tensor(done, device=_collective_device())):
            self._finalize(pending)

    def wait(self) -> None:
        """Block until the save in flight is written, then finalize it. Collective."""
        if self._pending is not None:
            self._finalize(self._pending)

    def finish(self) -> None:
        """The end of a job: the save in flight finalized and pruned checkpoints deleted."""
        self.wait()
        for thread in self._deleting:
            thread.join()
        self._deleting = []

    def _finalize(self, pending: _Pending) -> None:
        """Once every rank's files are durable, rank 0 marks and renames the directory; if any
        rank's state was not finite or its write failed, rank 0 removes it and every rank raises
        the same NonFiniteState or CheckpointSaveError."""
        self._pending = None
        error = pending.error
        if pending.future is not None:
            written = pending.future.result()
            error = error or written.error
            nonfinite = _first_of_ranks(written.nonfinite)
            if nonfinite is not None:
                if _rank() == 0:
                    shutil.rmtree(pending.tmp, ignore_errors=True)
                raise NonFiniteState(self._refusal(pending.step, nonfinite))
        error = _first_of_ranks(error)
        final = self.directory / step_name(pending.step)
        if error is None:
            error = self._complete(pending, final) if _rank() == 0 else None
            error = _broadcast_from_rank0(error)
        if error is not None:
            line = self._failure_line(pending.step, error, pending.tmp)
            if _rank() == 0:
                shutil.rmtree(pending.tmp, ignore_errors=True)
            raise CheckpointSaveError(line)
        if _rank() == 0:
            self._prune()
            log.info("saved checkpoint %s in %.2f s", final, time.perf_counter() - pending.started)

    def _complete(self, pending: _Pending, final: Path) -> dict | None:
        """Rank 0: state.json, then the marker, then the rename; the failure, if any."""
        if PAUSE_ENV in os.environ:
            how = "written in the background" if pending.future is not None else "written"
            _pause_if_armed(
                Path(os.environ[PAUSE_ENV]) / step_name(pending.step),
                pending.tmp,
                f"its files {how}, no {MARKER} marker yet",
            )
        try:
            _write_durably(pending.tmp / STATE_FILE, pending.state_json)
            _fsync_dir(pending.tmp)
            _write_durably(pending.tmp / MARKER, f"{time.time()}\n")
            if final.exists():
                shutil.rmtree(final)  # torn: its step had no marker
            pending.tmp.rename(final)
            _fsync_dir(self.directory)
        except OSError as exc:
            return _describe(exc, pending.tmp)
        return None

    def _intact(self) -> str:
        complete, _ = self._scan()
        return complete[max(complete)].name if complete else "(none yet)"

    def _refusal(self, step: int, nonfinite: str) -> str:
        return (
            f"not saving checkpoint step_{step}: {nonfinite} holds non-finite values (NaN or "
            f"inf); the last good checkpoint {self._intact()} is kept"
        )

    def _failure_line(self, step: int, failure: dict, where: Path) -> str:
        """``checkpoint step_40 not saved: no space left on device on /mnt (0 B free) writing
        PATH; free space or move the run dir; the previous checkpoint step_20 is intact``."""
        problem, fix = _DISK_PROBLEMS.get(failure["errno"], (failure["reason"], None))
        complete, _ = self._scan()
        previous = (
            f"the previous checkpoint {complete[max(complete)].name} is intact"
            if complete
            else "there is no earlier checkpoint"
        )
        return (
            f"checkpoint step_{step} not saved: {problem} on {_disk(where)} writing "
            f"{failure['path'] or where}; {fix or 'check the disk or move the run dir'}; "
            f"{previous}"
        )

    def _prune(self) -> None:
        """Keep the newest ``keep`` complete checkpoints; drop torn entries not newer than those.

        The doomed directories are renamed (fast) and deleted by a background thread, so no
        rank waits for the deletion; a job's start removes any it left behind."""
        complete, torn = self._scan()
        newest = max(complete)
        doomed = [complete[s] for s in sorted(complete)[: -self.keep]]
        doomed += [path for s, path in torn if s <= newest]
        trash = []
        for path in doomed:
            target = path.with_name(f"{_TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:12]}")
            try:
                path.rename(target)
            except OSError as exc:
                log.warning("could not remove old checkpoint %s: %s", path, exc)
                continue
            trash.append(target)
        if not trash:
            return
        log.info("removing old checkpoints: %s", ", ".join(p.name for p in doomed))
        thread = threading.Thread(
            target=_remove_all, args=(trash,), name="checkpoint-prune", daemon=True
        )
        thread.start()  # not waiting for the previous one: the finalize is on the loop's path
        self._deleting = [t for t in self._deleting if t.is_alive()] + [thread]

    # loading ----------------------------------------------------------------------------------

    def load_latest(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    ) -> tuple[Path, dict] | None:
        """Load the newest complete checkpoint that loads: (its path, its trainer_state), or
        None when there is none. Collective: rank 0 chooses the candidates, and a checkpoint
        that fails on any rank is skipped by every rank with a warning, then set aside as
        ``step_<N>.broken-<hex>`` once an older one has loaded (so it is neither retried nor
        kept in place of the next save). Raises CheckpointError when none of them loads."""
        complete, _ = self._scan() if _rank() == 0 else ({}, [])
        candidates = _broadcast_from_rank0([str(complete[s]) for s in sorted(complete)[::-1]])
        broken: list[Path] = []
        first_failure = ""
        for candidate in map(Path, candidates):
            try:
                trainer_state = self.load(candidate, model, optimizer, scheduler)
            except CheckpointError as exc:
                if _rank() == 0:
                    log.warning("skipping checkpoint %s: %s", candidate.name, exc)
                broken.append(candidate)
                first_failure = first_failure or str(exc)
                continue
            if _rank() == 0:
                for path in broken:
                    aside = path.with_name(f"{path.name}.broken-{uuid.uuid4().hex[:12]}")
                    path.rename(aside)
                    log.warning("set aside %s as %s: it did not load", path.name, aside.name)
            return candidate, trainer_state
        if broken:
            raise CheckpointError(
                f"no checkpoint in {self.directory} loads ({len(broken)} tried); the newest: "
                f"{first_failure}"
            )
        return None

    def load(
        self,
        path: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    ) -> dict:
        """Restore ``path`` into the objects given and return its trainer_state. Collective.

        The model may use any parallel layout, or none. Pass ``optimizer=None`` and
        ``scheduler=None`` to load the weights alone (e.g. for evaluation). A failure on any
        rank raises the same CheckpointError on every rank: the ranks agree after each step
        that reads files on its own, so none is left waiting in a collective.
        """
        started = time.perf_counter()
        path = Path(path)
        saved: dict = {}
        flat = True
        problem = None
        keys: set[str] = set()
        try:
            saved = self._read_state_file(path)
            keys = _saved_keys(path)
            flat = optimizer is None or LEGACY_OPTIMIZER_KEY not in keys
        except CheckpointError as exc:
            problem = str(exc)
        self._agree_loadable(problem)
        optimizers = () if optimizer is None else optimizer
        options = FLAT_OPTIMIZER if flat else None
        model_state, optim_state = get_state_dict(model, optimizers, options=options)
        state: dict[str, Any] = {"model": model_state}
        if optimizer is not None:
            state["optim"] = optim_state
        if scheduler is not None:
            state["scheduler"] = scheduler.state_dict()
        unfrozen = (
            _frozen_when_saved(optim_state, keys) if optimizer is not None and flat else set()
        )
        fresh = {
            k: optim_state.pop(k) for k in list(optim_state) if _optimizer_param(k) in unfrozen
        }
        try:
            dcp.load(state, checkpoint_id=path)  # DCP raises on every rank if one fails
        except CheckpointException as exc:
            failure = next(iter(exc.failures.values()))[0]
            reason = str(failure) or repr(failure)  # a torn file: EOFError() says nothing
            raise CheckpointError(f"cannot load checkpoint {path}: {reason}") from None
        optim_state.update(fresh)
        set_state_dict(
            model,
            optimizers,
            model_state_dict=state["model"],
            optim_state_dict=state.get("optim", {}),
            options=options,
        )
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
        if unfrozen:
            self._start_fresh(model, optimizer, unfrozen, path)
        self._agree_loadable(self._restore_rng(path, saved["world_size"]))
        if _rank() == 0:
            log.info("loaded checkpoint %s in %.2f s", path, time.perf_counter() - started)
        return saved["trainer_state"]

    @staticmethod
    def _start_fresh(
        model: nn.Module, optimizer: torch.optim.Optimizer, names: set[str], path: Path
    ) -> None:
        """AdamW's moments of ``names`` (trainable now, frozen in ``path``) start at zero, as
        for a new parameter: the optimizer fills in their state at its next step."""
        for name, param in model.named_parameters():
            if canonical_name(name) in names:
                optimizer.state.pop(param, None)
        if _rank() == 0:
            log.info(
                "optimizer state starts fresh for %d parameter tensor(s) frozen when %s was "
                "saved (model.freeze changed), e.g. %s",
                len(names),
                path.name,
                min(names),
            )

    @staticmethod
    def _agree_loadable(problem: str | None) -> None:
        problem = _first_of_ranks(problem)
        if problem is not None:
            raise CheckpointError(problem)

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
    def _restore_rng(path: Path, saved_world_size: int) -> str | None:
        """Restore this rank's RNG states (same world size only); a problem, or None."""
        if saved_world_size != _world_size():
            if _rank() == 0:
                log.warning(
                    "checkpoint %s was saved by %d ranks, this job has %d: RNG states not restored",
                    path,
                    saved_world_size,
                    _world_size(),
                )
            return None
        rng_file = _rng_file(path, _rank())
        try:
            state = torch.load(rng_file, weights_only=True)
        except Exception as exc:  # torn pickles fail with any of several errors
            return f"cannot load checkpoint {path}: {rng_file}: {exc!r}"
        _set_rng_state(state)
        return None
