"""A hung rank ends the job: a heartbeat that the training loop touches, watched by a thread.

A rank that is stopped (SIGSTOP, a frozen node) or stuck (a dead link, a wedged device) cannot act,
and its peers wait for it inside a collective, where no signal handler runs and no checkpoint can
be saved. Each rank's daemon thread therefore watches the heartbeat that the job touches as it
loads its checkpoint, at every step, and as a checkpoint save or a validation pass begins (the
validation as the job ends included). After ``train.hang_timeout_s`` seconds
without one it writes one ``error:`` line and ends the process with ``EXIT_HUNG`` through
``os._exit``, which no thread blocked in a collective can hold up. The launcher then stops the
other ranks (torchrun: SIGTERM, then SIGKILL 30 s later for a rank that cannot act) and the
chain's next job resumes from the last checkpoint. Nothing is saved: after a stalled collective
the ranks' states may disagree.

A stop signal (USR1 from SLURM, TERM) cannot make a blocked job save, and its Python handler only
runs once the main thread is back in Python. The thread sees the signal at once, through the
signal wakeup fd, and ends a rank stuck in a step, a save or a validation pass for
``SIGNAL_PATIENCE_S`` or three times the slowest earlier one of its kind, whichever is longer (never
in the first of its kind, which may compile or warm up): that job will never reach the step
boundary where it would save, and this way it ends with a clear line before its time limit. A job
that is still training goes on to save and exit 0 as usual.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType

from contract.job_end import EXIT_HUNG
from train.loop.stop import STOP_SIGNALS

PROCESS_GROUP_MARGIN_S = 30.0  # the process groups' timeout exceeds the watchdog's by this
SIGNAL_PATIENCE_S = 30.0  # after a stop signal: the least time a phase may hang before exit 5
SLOWEST_TIMES = 3  # ... or this many times the slowest earlier one of its kind, if longer
POLL_S = 1.0
STOP_NUMBERS = frozenset(int(signum) for signum in STOP_SIGNALS)
START = "the start of training"  # not timed as a phase: nothing has run yet
RESTORE = "loading the checkpoint"
STEP = "a training step"
SAVE = "a checkpoint save"
VALIDATION = "validation"
STOPPABLE = {"save": SAVE, "validation": VALIDATION}  # debug.stop_in's phases


def process_group_timeout(hang_timeout_s: float) -> timedelta | None:
    """The process groups' timeout: the watchdog's plus a margin, so that in the loop the
    watchdog's line comes first, and elsewhere (start-up, the checkpoint load, the validation as a
    job ends) a collective that waits for a hung rank still fails: gloo raises, and NCCL's own
    watchdog ends the process (torch's default TORCH_NCCL_ASYNC_ERROR_HANDLING=3). None (0):
    torch's defaults, 30 min for gloo and 10 for NCCL."""
    if hang_timeout_s <= 0:
        return None
    return timedelta(seconds=hang_timeout_s + PROCESS_GROUP_MARGIN_S)


@dataclass(frozen=True)
class Beat:
    time: float  # time.monotonic()
    step: int  # steps completed
    phase: str  # what the rank is doing since: START, RESTORE, STEP, SAVE or VALIDATION


class Watchdog:
    """``with Watchdog(timeout_s, rank):`` watches the loop; ``beat`` marks progress.

    ``timeout_s`` 0 turns it off. Enter it from the main thread (it sets the signal wakeup fd).
    ``stop_in`` (a ``STOPPABLE`` name) is a test's fault (``debug.stop_in``): the rank stops
    itself with SIGSTOP as it begins its first phase of that kind, a real hang at a chosen point.
    ``on_hang(step, line)`` runs just before the exit with the error line said (the trainer writes
    the job's end-of-job record).
    """

    def __init__(
        self,
        timeout_s: float,
        rank: int,
        stop_in: str | None = None,
        on_hang: Callable[[int, str], None] | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.rank = rank
        self._on_hang = on_hang
        self._stop_in = STOPPABLE[stop_in] if stop_in else None
        self._last = Beat(time.monotonic(), 0, START)
        self._slowest: dict[str, float] = {}  # the longest of each phase so far
        self._signal: tuple[str, float] | None = None  # (name, time) of the first stop signal
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._pipe: tuple[int, int] | None = None
        self._previous_fd = -1

    def beat(self, step: int, phase: str) -> None:
        """Progress: ``step`` steps are done and the rank now starts ``phase``."""
        now = time.monotonic()
        last = self._last
        if last.phase != START:
            self._slowest[last.phase] = max(self._slowest.get(last.phase, 0.0), now - last.time)
        self._last = Beat(now, step, phase)
        if phase == self._stop_in:
            self._stop_in = None
            os.kill(os.getpid(), signal.SIGSTOP)

    def __enter__(self) -> Watchdog:
        if self.timeout_s <= 0:
            return self
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # the signal handler must never block on it
        self._pipe = (read_fd, write_fd)
        self._previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._last = Beat(time.monotonic(), self._last.step, START)
        self._thread = threading.Thread(
            target=self._watch, args=(read_fd,), name="hang-watchdog", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(
        self,
        _type: type[BaseException] | None,
        _value: BaseException | None,
        _traceback: TracebackType | None,
    ) -> None:
        if self._thread is None or self._pipe is None:
            return
        self._done.set()
        self._thread.join()
        signal.set_wakeup_fd(self._previous_fd)
        for fd in self._pipe:
            os.close(fd)
        self._thread = self._pipe = None

    def _watch(self, read_fd: int) -> None:
        while not self._done.is_set():
            ready, _, _ = select.select([read_fd], [], [], POLL_S)
            if ready:
                self._note_signals(os.read(read_fd, 512))
            last, now = self._last, time.monotonic()
            idle = now - last.time
            if idle >= self.timeout_s:
                self._end(last, idle, "")
            slowest = self._slowest.get(last.phase, 0.0)
            patience = max(SIGNAL_PATIENCE_S, SLOWEST_TIMES * slowest)
            if self._signal and slowest and idle >= patience:
                name = self._signal[0]
                self._end(last, idle, f"{name} came {now - self._signal[1]:.0f} s ago but ")

    def _note_signals(self, numbers: bytes) -> None:
        """Remember the first stop signal; pass every byte on to a wakeup fd set before ours."""
        if self._previous_fd >= 0:
            with contextlib.suppress(OSError):  # as Python's handler does: full or gone
                os.write(self._previous_fd, numbers)
        stops = [signal.Signals(number).name for number in numbers if number in STOP_NUMBERS]
        if stops and self._signal is None:
            self._signal = (stops[0], time.monotonic())

    def _end(self, last: Beat, idle: float, signalled: str) -> None:
        line = (
            f"error: rank {self.rank}: the job is hung: {signalled}no progress for {idle:.0f} s in "
            f"{last.phase} after step {last.step} (train.hang_timeout_s={self.timeout_s:g}); "
            "another rank is probably stopped or stuck and this one waits for it in a "
            f"collective. Exiting with code {EXIT_HUNG}, saving nothing: the next job of the "
            "chain resumes from the last checkpoint. Check the other ranks' logs and nodes; "
            "raise train.hang_timeout_s if steps, saves or validation are legitimately slower\n"
        )
        os.write(2, line.encode())
        if self._on_hang is not None:
            with contextlib.suppress(Exception):  # the exit must come whatever the record does
                self._on_hang(last.step, line)
        os._exit(EXIT_HUNG)
