"""Python's cycle collector on a training rank: quiet while torch imports and the trainer
builds, then run by the training loop at the same steps on every rank (``train.gc_interval``).

Left automatic, the collector runs whenever enough container objects were allocated: ~680
times while the trainer's modules import (0.9 of the 5 CPU-seconds, 2026-11-29), and during
training at moments of each rank's own, so a step of many ranks waits for whichever rank
collected, and every full collection walks again each object torch made at import.

So: no automatic collection while the trainer imports and builds (``pause``); the objects made
until it is built are frozen (``gc.freeze``: never walked again, and the dataloader workers
forked from the rank share their memory pages instead of copying them as a collection touches
them); then a young-generation collection every ``gc_interval`` steps on every rank at once,
and a full one where every rank pauses together anyway (after a checkpoint save and after
validation). torchtitan does likewise (its ``gc_freq``, 50 steps). ``gc_interval=0`` leaves
Python's automatic collection on.
"""

from __future__ import annotations

import gc
from types import TracebackType

YOUNG = 1  # the generations below the oldest: what survived one collection or none


def pause() -> None:
    """No automatic collection from here (the imports and the build): the trainer's
    ``Collector`` decides what follows."""
    gc.disable()


def worker_start() -> None:
    """In a process forked from a rank (a dataloader worker): Python's automatic collection,
    the rank's frozen objects left frozen (``gc.freeze``'s advice for forked children)."""
    gc.enable()


class Collector:
    """The collections of one training run, a context for a process that runs more than the
    trainer: on exit the collector is switched back as it was, and everything frozen is
    unfrozen (what was frozen before the run too, such as a forking parent's heap)."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.was_enabled = True

    def __enter__(self) -> Collector:
        self.was_enabled = gc.isenabled()
        gc.freeze()
        if self.interval:
            gc.disable()
        else:
            gc.enable()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        gc.unfreeze()
        if self.was_enabled:
            gc.enable()
        else:
            gc.disable()

    def after_step(self, step: int) -> None:
        if self.interval and step % self.interval == 0:
            gc.collect(YOUNG)

    def at_pause(self) -> None:
        """A full collection, where every rank waits for the slowest anyway (a save, a
        validation pass)."""
        if self.interval:
            gc.collect()
