"""The checkpoints of one run directory: saved, found, loaded and pruned by ``CheckpointManager``.

Layout of ``run_dir/checkpoints``::

    step_<N>/                 one complete checkpoint
        .metadata, *.distcp   DCP: model, optimizer and LR scheduler state (one copy, any layout)
        rng/rank_<r>.pt       RNG states of global rank r (torch CPU, CUDA, numpy, python)
        state.json            {"step", "world_size", "trainer_state", "references"}; no torch
        COMPLETE              the marker, written last
    .tmp-step_<N>-<unique>/   a save in progress, or one torn by a crash (removed at start)
    .trash-<name>-<unique>/   a pruned checkpoint being deleted in the background
    step_<N>.broken-<unique>/ a complete checkpoint that failed to load, set aside for a look

Model and optimizer go through ``get_state_dict``/``set_state_dict``, which hand DCP DTensors
(FSDP2/TP/EP) under their global shapes with FQN keys, so the checkpoint holds one copy whatever
the data-parallel degree, and loads under another layout (DCP reshards) or into a plain
single-process model. Under pipeline parallelism a rank holds some of the parameters only; the
optimizer state is flattened to per-parameter keys, so every rank saves and loads exactly its
own parameters' entries whatever the stage split; their hyperparameters are kept once
(``train.checkpoint.hyperparameters``). Checkpoints
written before that (with the optimizer's param groups as lists) still load, under layouts
without pipeline parallelism. The LR scheduler is replicated on every rank; DCP keeps one copy.

Frozen parameters of a pretrained part (``by_reference``) are left out of the DCP state;
``references`` records each such part's directory and its files' digests
(``train.checkpoint.references``), and a load fills them from those files before the rest.

``trainer_state`` is the trainer's small JSON dict (step, tokens seen, W&B run id, data
position, ...). It lives in ``state.json`` so that tools without torch can read where a run is.
The RNG files are per rank (``train.checkpoint.rng``).

Atomicity: every rank writes (and fsyncs) its files into the temporary directory; once every
rank's write has succeeded rank 0 writes ``state.json`` and then the ``COMPLETE`` marker there,
and renames the directory to ``step_<N>``. The marker goes in before the rename, so a
``step_<N>`` directory is always whole; one without the marker (copied or damaged by hand) is
torn and skipped like leftover ``.tmp-*`` directories, which are never loaded.

Asynchronous saves (``async_save``): while the loop waits, the state is copied into reused CPU
buffers (``train.checkpoint.staging``). A background thread then checks that copy for
non-finite values, and DCP writes it (with nothing left to stage) over a gloo group of its own
(its collectives would otherwise interleave with the training loop's), along with the RNG file.
DCP's save returns once every rank's files are written (the ranks all-reduce, before it, that
every copy is finite and every RNG file written), so rank 0's background thread then marks the
save complete (marker and rename, as above) and prunes, off the training's path. The save is
finalized at a step boundary where every rank agrees its write is done (``poll``), or before
the next save or the end of the job (``wait``): all ranks learn there, at the same call, whether
it failed. A crash before the marker leaves only a ``.tmp-*`` directory.

A save that fails (disk full, read-only, no permission) removes its temporary directory once
every rank has given up and raises ``CheckpointSaveError``: one line naming the problem, the
disk and its free space, the path (``train.checkpoint.disk``) and the checkpoint that is still
intact. Parameters or optimizer states that are not finite are never written (``NonFiniteState``:
raised by ``save`` after ``train.checkpoint.nonfinite``'s scan, or for an asynchronous save by
the finalize, which removes the temporary directory instead of marking it). Old checkpoints are
pruned by renaming them to ``.trash-*`` and deleting those in a background thread, so no rank
waits for the deletion.

Tests tear a real save by pausing it at a known moment (``train.checkpoint.pauses_for_tests``),
armed when the manager is built.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

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

from contract.run_dir import MARKER, STATE_FILE, step_name
from train.checkpoint.collectives import (
    all_ranks,
    broadcast_from_rank0,
    collective_device,
    first_of_ranks,
    global_rank,
    world_size,
)
from train.checkpoint.hyperparameters import expanded, saved_shared, shared, to_load
from train.checkpoint.location import Ref, is_complete
from train.checkpoint.nonfinite import (
    first_nonfinite,
    local_nonfinite,
    local_tensors,
    squares_finite,
)
from train.checkpoint.pauses_for_tests import armed_pauses
from train.checkpoint.places import DirectoryPlace, ObjectPlace, Place, place_of
from train.checkpoint.references import (
    REFERENCES,
    PretrainedPartChanged,
    identity,
    mismatch,
    part_directory,
    refusal,
)
from train.checkpoint.rng import restore_rng, rng_bytes, rng_name, rng_state
from train.checkpoint.staging import Staging
from train.data.storage import StorageError, is_url
from train.models.hf_weights import PART_LOADERS
from train.models.init import canonical_name
from train.models.pretrained_parts import PARTS, part_of

log = logging.getLogger(__name__)

FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True)
# Only list-style param groups (before pipelines) have this key: a flattened one ends in a
# hyperparameter's name.
LEGACY_OPTIMIZER_KEY = "optim.param_groups.0.params"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read; the message names its path."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint that could not be written (disk full, read-only, ...): one line that names
    the problem, the disk, the path and the checkpoint still intact."""


class NonFiniteState(RuntimeError):
    """Parameters or optimizer states hold NaN or inf: nothing was saved."""


def _saved_keys(place: Place, path: Ref) -> set[str]:
    """The keys of the checkpoint at ``path`` (``model.<name>``, ``optim.state.<name>.<field>``)."""
    try:
        return set(place.reader(path).read_metadata().state_dict_metadata)
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


def _frozen_when_saved(optim_state: dict, saved: set[str], referenced: set[str]) -> set[str]:
    """The parameters that train now but were frozen when the checkpoint was saved (a
    ``model.freeze`` rule changed between jobs): their weights are in it, or in a pretrained
    part it ``referenced``, their optimizer state is not. Every other key is loaded as strictly
    as before."""
    with_state = {_optimizer_param(key[len("optim.") :]) for key in saved if key[:6] == "optim."}
    training = {_optimizer_param(key) for key in optim_state} - {None}
    return {
        n  # type: ignore[misc]
        for n in training
        if n not in with_state and (f"model.{n}" in saved or _in_part(n, saved, referenced))
    }


def _in_part(name: str, saved: set[str], referenced: set[str]) -> bool:
    """Whether model parameter ``name`` (as the state dict names it) is left out of a
    checkpoint whose ``saved`` keys hold the others, its weights in one of the ``referenced``
    pretrained parts."""
    return f"model.{name}" not in saved and part_of(canonical_name(name)) in referenced


def _staged_nonfinite(
    state: dict, group: dist.ProcessGroup | None, ok: bool
) -> tuple[str | None, bool]:
    """The check of a staged CPU copy, in the background write (beside it: a collective over
    the manager's own group): this rank's first non-finite tensor (or None), and whether every
    rank's copy is finite and every rank's own writes so far ``ok`` (one all-reduce over
    ``group``, a CPU group; None: this process alone)."""
    tensors = list(local_tensors(state))
    bad = None if squares_finite(tensors).item() else local_nonfinite(tensors)
    finite = torch.tensor(float(bad is None and ok), device="cpu")
    if group is not None:
        dist.all_reduce(finite, op=dist.ReduceOp.MIN, group=group)
    return bad, bool(finite.item())


@dataclass
class _Written:
    """What a background write of one rank found (``_Pending.future``'s result)."""

    nonfinite: str | None = None  # this rank's first non-finite tensor: nothing was written
    error: dict | None = None  # a failed write (``describe``)
    marked: bool = False  # rank 0: the save marked complete (and pruned) in the background


@dataclass
class _Pending:
    """A save whose files are being written into ``tmp``, finalized by ``_finalize``."""

    step: int
    tmp: Ref
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
        interval: int = 0,
        location: str | None = None,
        pretrained: dict[str, str | None] | None = None,
        by_reference: frozenset[str] = frozenset(),
    ) -> None:
        """``timeout``: of the background saves' gloo group (the trainer gives every process
        group the same, ``train.loop.watchdog.process_group_timeout``); None: gloo's default.
        ``interval``: the training saves every so many steps (``due``); 0: only as it ends.
        ``location``: the run's s3:// prefix (the trainer's ``checkpoint.location``, settled);
        None: where the run dir says (``train.checkpoint.location``), else its checkpoints/.
        ``pretrained``: the config's pretrained directories by part (``pretrained_dirs``), where
        a load finds the parts a checkpoint holds by reference (else where it recorded them).
        ``by_reference``: the parts (keys of ``PARTS``, each in ``pretrained``) whose frozen
        parameters a save leaves out, recording the part's directory and digests instead."""
        if keep < 1:
            raise ValueError(f"keep={keep} must be at least 1 (the checkpoint to resume from)")
        unknown = sorted(part for part in by_reference if not (pretrained or {}).get(part))
        if unknown:
            raise ValueError(f"by_reference={unknown}: parts without a pretrained directory")
        self.place = ObjectPlace(location) if location else place_of(Path(run_dir))
        self.keep = keep
        self.interval = interval
        self.pretrained = dict(pretrained or {})
        self.by_reference = by_reference
        self._identities: dict[str, dict] = {}  # rank 0: each part's record, its digests kept
        self._pending: _Pending | None = None
        self._deleting: list[threading.Thread] = []
        self._staging: Staging | None = None
        self._group: dist.ProcessGroup | None = None
        self._pauses = armed_pauses()  # tests only; read here, not in every save
        if async_save:
            # One save is in flight at most: the next one first finalizes it, then restages.
            self._staging = Staging()
            if dist.is_initialized():
                self._group = dist.new_group(backend="gloo", timeout=timeout)

    def due(self, step: int, last: bool) -> bool:
        """Whether the training saves after ``step`` on its way (the last step's save is the
        job's own, as it ends)."""
        return bool(self.interval) and step % self.interval == 0 and not last

    @property
    def pending(self) -> bool:
        """Whether a save is still being written (async_save) and not yet finalized."""
        return self._pending is not None

    def _scan(self) -> tuple[dict[int, Ref], list[tuple[int, Ref]]]:
        """Complete checkpoints by step, and the torn entries (no marker, saves in progress)."""
        return self.place.scan()

    def latest(self) -> Ref | None:
        """The newest complete checkpoint, or None; torn ones are skipped with a warning."""
        complete, torn = self._scan()
        if torn and global_rank() == 0:
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
        if global_rank() != 0:
            return
        leftovers = self.place.leftovers()
        if leftovers:
            names = ", ".join(self.place.name(ref) for ref in leftovers)
            log.warning("removing what earlier jobs left: %s", names)
            for ref in leftovers:
                self.place.discard(ref)

    def check_room(self) -> None:
        """Raise CheckpointSaveError (every rank, one line) if a checkpoint cannot be saved: the
        directory is not writable or has less room than the newest checkpoint took. Collective."""
        problem = self.place.room_problem() if global_rank() == 0 else None
        problem = broadcast_from_rank0(problem)
        if problem is not None:
            raise CheckpointSaveError(problem)

    # saving -----------------------------------------------------------------------------------

    def identify_pretrained(self) -> None:
        """Rank 0: hash the weight files of the parts saved by reference now, while a job
        starts (they were just read), rather than in its first save. A file that cannot be read
        is left for that save to report."""
        if global_rank() != 0:
            return
        try:
            self._references()
        except OSError as exc:
            log.warning("pretrained files not identified yet: %s", exc)

    def _references(self) -> dict[str, dict]:
        """Rank 0: the record of each part saved by reference (``train.checkpoint.references``);
        a file hashed before keeps its digest while its size and modification time stand."""
        for part in sorted(self.by_reference):
            directory = Path(self.pretrained[part])  # type: ignore[arg-type]
            self._identities[part] = identity(directory, self._identities.get(part))
        return {part: self._identities[part] for part in sorted(self.by_reference)}

    def _left_out(self, model: nn.Module) -> set[str]:
        """The names (canonical) of this rank's frozen parameters of the parts saved by
        reference, a tied head under its own name too."""
        if not self.by_reference:
            return set()
        names = set()
        for name, param in model.named_parameters(remove_duplicate=False):
            name = canonical_name(name)
            if not param.requires_grad and part_of(name) in self.by_reference:
                names.add(name)
        return names

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
        record = {"step": step, "world_size": world_size(), "trainer_state": trainer_state}
        try:
            json.dumps(record)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"trainer_state must be JSON-serialisable: {exc}") from exc
        self.wait()
        model_state, optim_state = get_state_dict(model, optimizer, options=FLAT_OPTIMIZER)
        optim_state = shared(optim_state)
        left_out = self._left_out(model)
        model_state = {k: v for k, v in model_state.items() if canonical_name(k) not in left_out}
        state = {"model": model_state, "optim": optim_state, "scheduler": scheduler.state_dict()}
        if self._staging is None:  # an asynchronous save checks its copy in the background
            bad = first_nonfinite(state)
            if bad is not None:
                raise NonFiniteState(self._refusal(step, bad))
        made: Ref | dict | None = None
        state_json = ""  # rank 0's: written as the save completes
        if global_rank() == 0:
            try:
                references = self._references()
                made = self.place.begin(step)
            except (OSError, StorageError) as exc:
                made = self.place.describe(exc, self.place.where)
            else:
                state_json = json.dumps({**record, REFERENCES: references}, indent=1)
        made = broadcast_from_rank0(made)
        if made is None:
            final = self.place.final(step)
            if global_rank() == 0:
                log.info("checkpoint %s already exists: not saving step %d again", final, step)
            return final
        if isinstance(made, dict):
            raise CheckpointSaveError(self._failure_line(step, made, self.place.where))
        pending = _Pending(step, made, state_json, started)
        if self._staging is not None:
            staged = self._staging.stage(state)
            writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-write")
            pending.future = writer.submit(self._write, pending, staged, rng_state())
            writer.shutdown(wait=False)  # its thread ends with this write
            self._pending = pending
            if global_rank() == 0:
                log.info(
                    "checkpoint %s staged in %.2f s, written in the background",
                    step_name(step),
                    time.perf_counter() - started,
                )
            return self.place.final(step)
        try:
            self.place.put(pending.tmp, rng_name(global_rank()), rng_bytes(rng_state()))
        except (OSError, StorageError) as exc:
            pending.error = self.place.describe(exc, pending.tmp)
        try:
            dcp.save(state, storage_writer=self.place.writer(pending.tmp, background=False))
        except (CheckpointException, OSError) as exc:
            pending.error = pending.error or self.place.describe(exc, pending.tmp)
        self._finalize(pending)
        return self.place.final(step)

    def _write(self, pending: _Pending, staged: dict, rng: dict[str, Any]) -> _Written:
        """The background write of an asynchronous save: the RNG file, then, if every rank's
        staged copy is finite and its RNG file written, DCP's files (a collective over this
        manager's gloo group). DCP's save returns once every rank's files are written, so rank
        0 then marks the save complete and prunes, here, off the training's path (object
        storage answers in tens of milliseconds a request); the finalize only agrees."""
        step, tmp = pending.step, pending.tmp
        written = _Written()
        try:
            self.place.put(tmp, rng_name(global_rank()), rng_bytes(rng))
        except (OSError, StorageError) as exc:
            written.error = self.place.describe(exc, tmp)
        written.nonfinite, good = _staged_nonfinite(staged, self._group, written.error is None)
        if not good:
            return written
        if self._pauses is not None and global_rank() == 0:  # the others wait in dcp.save
            self._pauses.before_write(step, tmp)
        writer = self.place.writer(tmp, background=True)
        try:
            dcp.save(staged, storage_writer=writer, process_group=self._group)
        except (CheckpointException, OSError) as exc:
            written.error = written.error or self.place.describe(exc, tmp)
            return written
        if global_rank() == 0:
            written.error = self._complete(pending)
            written.marked = written.error is None
            if written.marked:
                self._prune()
        return written

    def poll(self) -> None:
        """Finalize the save in flight if every rank's write is done; else leave it running.
        Collective when a save is in flight (call it on every rank at the same steps)."""
        pending = self._pending
        if pending is None:
            return
        done = pending.future is None or pending.future.done()
        if all_ranks(torch.tensor(done, device=collective_device())):
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
        """Once every rank's files are durable, rank 0 marks and renames the directory (an
        asynchronous save's background thread has done so already); if any rank's state was not
        finite or its write failed, rank 0 removes it and every rank raises the same
        NonFiniteState or CheckpointSaveError."""
        self._pending = None
        error = pending.error
        if pending.future is not None:
            written = pending.future.result()
            error = error or written.error
            nonfinite = first_of_ranks(written.nonfinite)
            if nonfinite is not None:
                if global_rank() == 0:
                    self.place.discard(pending.tmp)
                raise NonFiniteState(self._refusal(pending.step, nonfinite))
        error = first_of_ranks(error)
        final = self.place.final(pending.step)
        marked = pending.future is not None and pending.future.result().marked
        if error is None:
            error = self._complete(pending) if global_rank() == 0 and not marked else None
            error = broadcast_from_rank0(error)
        if error is not None:
            line = self._failure_line(pending.step, error, pending.tmp)
            if global_rank() == 0:
                self.place.discard(pending.tmp)
            raise CheckpointSaveError(line)
        if global_rank() == 0:
            if not marked:
                self._prune()
            log.info("saved checkpoint %s in %.2f s", final, time.perf_counter() - pending.started)

    def _complete(self, pending: _Pending) -> dict | None:
        """Rank 0: state.json, then the marker (then, on disk, the rename); the failure."""
        if self._pauses is not None:
            how = "written in the background" if pending.future is not None else "written"
            self._pauses.before_marker(pending.step, pending.tmp, how)
        try:
            self.place.finish(pending.tmp, pending.step, pending.state_json, f"{time.time()}\n")
        except (OSError, StorageError) as exc:
            return self.place.describe(exc, pending.tmp)
        return None

    def _intact(self) -> str:
        complete, _ = self._scan()
        return self.place.name(complete[max(complete)]) if complete else "(none yet)"

    def _refusal(self, step: int, nonfinite: str) -> str:
        return (
            f"not saving checkpoint step_{step}: {nonfinite} holds non-finite values (NaN or "
            f"inf); the last good checkpoint {self._intact()} is kept"
        )

    def _failure_line(self, step: int, failure: dict, where: Ref) -> str:
        """``checkpoint step_40 not saved: no space left on device on /mnt (0 B free) writing
        PATH; free space or move the run dir; the previous checkpoint step_20 is intact``."""
        complete, _ = self._scan()
        previous = (
            f"the previous checkpoint {self.place.name(complete[max(complete)])} is intact"
            if complete
            else "there is no earlier checkpoint"
        )
        return (
            f"checkpoint step_{step} not saved: {self.place.failure_text(failure, where)}; "
            f"{previous}"
        )

    def _prune(self) -> None:
        """Keep the newest ``keep`` complete checkpoints; drop torn entries not newer than those.

        The doomed are taken out at once (renamed on disk, their markers deleted in a bucket)
        and removed by a background thread, so no rank waits for the deletion; a job's start
        removes any it left behind."""
        complete, torn = self._scan()
        newest = max(complete)
        doomed = [complete[s] for s in sorted(complete)[: -self.keep]]
        doomed += [ref for s, ref in torn if s <= newest]
        try:
            removal = self.place.doom(doomed) if doomed else None
        except (OSError, StorageError) as exc:
            log.warning("could not remove old checkpoints: %s", exc)
            return
        if removal is None:
            return
        log.info("removing old checkpoints: %s", ", ".join(map(self.place.name, doomed)))
        thread = threading.Thread(target=removal, name="checkpoint-prune", daemon=True)
        thread.start()  # not waiting for the previous one: the finalize is on the loop's path
        self._deleting = [t for t in self._deleting if t.is_alive()] + [thread]

    # loading ----------------------------------------------------------------------------------

    def load_latest(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    ) -> tuple[Ref, dict] | None:
        """Load the newest complete checkpoint that loads: (its place, its trainer_state), or
        None when there is none. Collective: rank 0 chooses the candidates, and a checkpoint
        that fails on any rank is skipped by every rank with a warning, then set aside as
        ``step_<N>.broken-<hex>`` once an older one has loaded (so it is neither retried nor
        kept in place of the next save). Raises CheckpointError when none of them loads."""
        complete, _ = self._scan() if global_rank() == 0 else ({}, [])
        candidates = broadcast_from_rank0([complete[s] for s in sorted(complete)[::-1]])
        broken: list[Ref] = []
        first_failure = ""
        for candidate in candidates:
            try:
                trainer_state = self.load(candidate, model, optimizer, scheduler)
            except CheckpointError as exc:
                if global_rank() == 0:
                    log.warning("skipping checkpoint %s: %s", self.place.name(candidate), exc)
                broken.append(candidate)
                first_failure = first_failure or str(exc)
                continue
            if global_rank() == 0:
                for ref in broken:
                    aside = self.place.set_aside(ref)
                    log.warning("set aside %s as %s: it did not load", self.place.name(ref), aside)
            return candidate, trainer_state
        if broken:
            raise CheckpointError(
                f"no checkpoint in {self.place.where} loads ({len(broken)} tried); the newest: "
                f"{first_failure}"
            )
        return None

    def load(
        self,
        path: Ref,
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
        place = self._reading(path)
        path = path if isinstance(place, ObjectPlace) else Path(path)
        saved: dict = {}
        flat = True
        problem = None
        keys: set[str] = set()
        try:
            saved = self._read_state_file(place, path)
            keys = _saved_keys(place, path)
            flat = optimizer is None or LEGACY_OPTIMIZER_KEY not in keys
        except CheckpointError as exc:
            problem = str(exc)
        self._agree_loadable(problem)
        references = saved.get(REFERENCES, {})
        self._load_parts(path, model, references)
        optimizers = () if optimizer is None else optimizer
        options = FLAT_OPTIMIZER if flat else None
        model_state, optim_state = get_state_dict(model, optimizers, options=options)
        if references:  # the parts' parameters are loaded: the rest comes from the checkpoint
            options = StateDictOptions(flatten_optimizer_state_dict=flat, strict=False)
            parts = set(references)
            model_state = {k: v for k, v in model_state.items() if not _in_part(k, keys, parts)}
        unfrozen = (
            _frozen_when_saved(optim_state, keys, set(references))
            if optimizer is not None and flat
            else set()
        )
        fresh = {
            k: optim_state.pop(k) for k in list(optim_state) if _optimizer_param(k) in unfrozen
        }
        once = optimizer is not None and flat and saved_shared(keys)
        state: dict[str, Any] = {"model": model_state}
        if optimizer is not None:
            state["optim"] = to_load(optim_state) if once else optim_state
        if scheduler is not None:
            state["scheduler"] = scheduler.state_dict()
        try:
            dcp.load(state, storage_reader=place.reader(path))  # raises on every rank if one fails
        except CheckpointException as exc:
            failure = next(iter(exc.failures.values()))[0]
            reason = str(failure) or repr(failure)  # a torn file: EOFError() says nothing
            raise CheckpointError(f"cannot load checkpoint {path}: {reason}") from None
        loaded = state.get("optim", {})
        if once:
            loaded = expanded(loaded, optim_state)
        loaded.update(fresh)
        set_state_dict(
            model,
            optimizers,
            model_state_dict=state["model"],
            optim_state_dict=loaded,
            options=options,
        )
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
        if unfrozen:
            self._start_fresh(model, optimizer, unfrozen, path)
        self._agree_loadable(restore_rng(place, path, saved["world_size"]))
        if global_rank() == 0:
            log.info("loaded checkpoint %s in %.2f s", path, time.perf_counter() - started)
        return saved["trainer_state"]

    def _load_parts(self, path: Path, model: nn.Module, references: dict[str, dict]) -> None:
        """Load the pretrained parts checkpoint ``path`` holds by reference, from the config's
        directory for each (else the recorded one), once rank 0 has found its files to be the
        recorded ones (PretrainedPartChanged on every rank otherwise). Collective."""
        problem = None
        if global_rank() == 0:
            for part, record in references.items():
                directory = part_directory(part, record, self.pretrained)
                found = mismatch(record, directory)
                if found is not None:
                    problem = refusal(path, part, record, found)
                    break
                if part in self.by_reference and str(directory) == record["directory"]:
                    self._identities[part] = record  # the next save keeps its digests
        problem = first_of_ranks(problem)
        if problem is not None:
            raise PretrainedPartChanged(problem)
        for part, record in references.items():
            directory = part_directory(part, record, self.pretrained)
            PART_LOADERS[part](model, directory)
            if global_rank() == 0:
                log.info("%s held by reference: loaded from %s", PARTS[part], directory)

    @staticmethod
    def _start_fresh(
        model: nn.Module, optimizer: torch.optim.Optimizer, names: set[str], path: Path
    ) -> None:
        """AdamW's moments of ``names`` (trainable now, frozen in ``path``) start at zero, as
        for a new parameter: the optimizer fills in their state at its next step."""
        for name, param in model.named_parameters():
            if canonical_name(name) in names:
                optimizer.state.pop(param, None)
        if global_rank() == 0:
            log.info(
                "optimizer state starts fresh for %d parameter tensor(s) frozen when %s was "
                "saved (model.freeze changed), e.g. %s",
                len(names),
                path.name,
                min(names),
            )

    @staticmethod
    def _agree_loadable(problem: str | None) -> None:
        problem = first_of_ranks(problem)
        if problem is not None:
            raise CheckpointError(problem)

    def _reading(self, path: Ref) -> Place:
        """The place that reads checkpoint ``path``: the manager's, or the one its name says (a
        checkpoint given by hand, elsewhere)."""
        url = isinstance(path, str) and is_url(path)
        if url == isinstance(self.place, ObjectPlace):
            return self.place
        return ObjectPlace(str(path)) if url else DirectoryPlace(Path(path).parent)

    @staticmethod
    def _read_state_file(place: Place, path: Ref) -> dict:
        try:
            complete = is_complete(path)
        except StorageError as exc:
            raise CheckpointError(f"cannot load checkpoint {path}: {exc}") from None
        if not complete:
            raise CheckpointError(
                f"cannot load checkpoint {path}: it is not a complete checkpoint (no {MARKER} "
                "marker); pass a path that latest() returns"
            )
        try:
            saved = json.loads(place.get(path, STATE_FILE))
            return {
                "world_size": int(saved["world_size"]),
                "trainer_state": saved["trainer_state"],
                REFERENCES: dict(saved.get(REFERENCES, {})),
            }
        except (OSError, ValueError, KeyError, TypeError, StorageError) as exc:
            raise CheckpointError(
                f"cannot load checkpoint {path}: unreadable {STATE_FILE} ({exc!r})"
            ) from None
