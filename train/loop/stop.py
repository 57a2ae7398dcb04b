"""Stopping cleanly: a signal, the job's time limit or its time budget ends training at a step
boundary.

SLURM warns a job with USR1 (the templates ask for ``--signal=B:USR1@grace`` and forward it to
the ranks); SIGTERM comes with cancellation or preemption. As SLURM's warning can be late or lost,
the batch script also hands the training the moment to stop (``ORCH_STOP_AT``, the job's end
time less the grace). A handler only sets a flag. At the
trainer's sync steps (log steps and every ``train.sync_every`` steps) the ranks agree with one
all_reduce (MAX) of ``local_flag``, so they all save the same step and exit 0 together, and the
next job of the chain resumes from that checkpoint.
"""

from __future__ import annotations

import atexit
import signal
import time
from collections.abc import Mapping

from contract import job_env

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


def ignore_usr1_from_exit() -> None:
    """As the interpreter exits, Python puts back the default action of every signal it
    handled, and USR1's terminates. The batch script passes USR1 on every 5 s until the
    training has exited, so one landing then would kill a rank that stopped cleanly (exit 138;
    torchrun: exit 1, the job FAILED). From exit on it is ignored again, as the ranks started."""
    atexit.register(signal.signal, signal.SIGUSR1, signal.SIG_IGN)


class StopRequest:
    def __init__(self, max_time_per_run: float = 0.0, stop_at: float | None = None) -> None:
        self.signal_name: str | None = None
        self.max_time_per_run = max_time_per_run
        self.stop_at = stop_at  # epoch seconds (the job's time limit less the grace); None: none
        self.started = time.monotonic()

    @classmethod
    def for_job(cls, max_time_per_run: float, environ: Mapping[str, str]) -> StopRequest:
        """The stop request of a job: its budget, and the stop time its batch script exported."""
        value = environ.get(job_env.STOP_AT, "")
        try:
            stop_at = float(value) if value else None
        except ValueError:
            raise ValueError(
                f"{job_env.STOP_AT}={value!r} is not epoch seconds; the batch template sets it "
                "from squeue's end time: unset it, or set a number"
            ) from None
        return cls(max_time_per_run, stop_at)

    def install(self) -> None:
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)
        ignore_usr1_from_exit()

    def _handle(self, signum: int, _frame: object) -> None:
        self.signal_name = signal.Signals(signum).name

    def wait_for_signal(self, seconds: float) -> None:
        """Sleep until a stop signal arrives or ``seconds`` pass (signals are handled, so a
        plain sleep would outlast a launcher's SIGTERM)."""
        deadline = time.monotonic() + seconds
        while self.signal_name is None and time.monotonic() < deadline:
            time.sleep(0.1)

    def over_budget(self) -> bool:
        budget = self.max_time_per_run
        return budget > 0 and time.monotonic() - self.started >= budget

    def near_time_limit(self) -> bool:
        return self.stop_at is not None and time.time() >= self.stop_at

    def local_flag(self) -> float:
        """This rank's wish to stop, for a MAX all-reduce: 2 a signal, 1 the job's time limit or
        its budget, 0 none."""
        if self.signal_name:
            return 2.0
        return 1.0 if self.near_time_limit() or self.over_budget() else 0.0

    @staticmethod
    def signalled(agreed_flag: float) -> bool:
        """Whether a signal on some rank, not a budget, is why they stop."""
        return agreed_flag >= 2

    def reason(self, agreed_flag: float) -> str | None:
        """Why every rank stops, given the MAX of all ranks' ``local_flag``; None: go on."""
        if self.signalled(agreed_flag):
            return self.signal_name or "a stop signal on another rank"
        if agreed_flag >= 1 and self.near_time_limit():
            return f"the job's time limit is near ({job_env.STOP_AT})"
        if agreed_flag >= 1:
            return "time budget (train.max_time_per_run)"
        return None
