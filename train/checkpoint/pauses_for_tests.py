"""For tests only: pauses inside a real checkpoint save, so that a test can kill the job at a
known moment and tear the save (a tiny model's save takes a fraction of a second, too short to
hit by luck).

With ``ORCH_TEST_CHECKPOINT_PAUSES`` (``PAUSE_ENV``) set to a directory, a test arms a pause at
step N by writing a number of seconds to ``DIR/step_N``. Rank 0 then pauses the finalize of that
step's save (sync or async) for that long, with every rank's files written and no marker yet,
after renaming the file to ``DIR/step_N.paused``, which then says where it paused: the moment
for the test to kill the job and tear the save. ``DIR/write_step_N`` instead pauses an
asynchronous save's background thread before DCP writes the staged copy, while training goes on
and changes the live weights: the staged copy must still be written. Each armed file pauses one
save (the next job's save of the same step goes through).

The variable crosses into the trainer's processes as any other does, and is read once, when a
``CheckpointManager`` is built (``armed_pauses``): unset, the manager holds None and its saves
look nothing up.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from contract.run_dir import MARKER, step_name
from train.checkpoint.disk import write_durably

log = logging.getLogger(__name__)

PAUSE_ENV = "ORCH_TEST_CHECKPOINT_PAUSES"  # the directory of armed pauses
PAUSED_SUFFIX = ".paused"  # what an armed file is renamed to when its pause begins
WRITE_PAUSE_PREFIX = "write_"  # + the step's name: a pause before an async save's DCP write


@dataclass(frozen=True)
class Pauses:
    """The pauses armed in ``directory`` (``PAUSE_ENV``), each looked for where a save may be
    torn."""

    directory: Path

    def before_marker(self, step: int, tmp: Path | str, how: str) -> None:
        """Rank 0, finalizing step ``step``'s save in ``tmp`` (its files ``how``: written, or
        written in the background)."""
        self._pause_if_armed(
            self.directory / step_name(step), tmp, f"its files {how}, no {MARKER} marker yet"
        )

    def before_write(self, step: int, tmp: Path | str) -> None:
        """Rank 0's background write of step ``step``'s staged copy into ``tmp``."""
        self._pause_if_armed(
            self.directory / f"{WRITE_PAUSE_PREFIX}{step_name(step)}",
            tmp,
            "its staged copy not yet written, training going on",
        )

    @staticmethod
    def _pause_if_armed(arm: Path, tmp: Path | str, what: str) -> None:
        """If ``arm`` exists, disarm it by renaming it to ``<arm>.paused`` (holding the line
        below, so a test that sees the file can read it whole), then sleep its number of
        seconds."""
        try:
            seconds = float(arm.read_text())
        except FileNotFoundError:
            return
        line = f"checkpoint write paused at {tmp} for {seconds:g} s: {what} ({PAUSE_ENV})"
        write_durably(arm, f"{line}\n")
        arm.rename(arm.with_name(f"{arm.name}{PAUSED_SUFFIX}"))
        log.warning(line)
        time.sleep(seconds)


def armed_pauses() -> Pauses | None:
    """The pauses tests armed for this process, or None (``PAUSE_ENV`` unset)."""
    directory = os.environ.get(PAUSE_ENV)
    return None if directory is None else Pauses(Path(directory))
