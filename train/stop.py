"""Stopping cleanly: a signal or the job's time budget ends training at a step boundary.

SLURM warns a job with USR1 (the templates ask for ``--signal=B:USR1@grace`` and forward it to
the ranks); SIGTERM comes with cancellation or preemption. A handler only sets a flag. At each
step boundary the ranks agree with one all_reduce (MAX), so they all save the same step and
exit 0 together, and the next job of the chain resumes from that checkpoint.
"""

from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopRequest:
    def __init__(self, max_time_per_run: float = 0.0) -> None:
        self.signal_name: str | None = None
        self.max_time_per_run = max_time_per_run
        self.started = time.monotonic()

    def install(self) -> None:
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        self.signal_name = signal.Signals(signum).name

    def over_budget(self) -> bool:
        budget = self.max_time_per_run
        return budget > 0 and time.monotonic() - self.started >= budget

    def agreed(self, device: torch.device) -> str | None:
        """Why every rank stops now ("SIGUSR1", "time budget"), or None: a collective call."""
        local = 2.0 if self.signal_name else 1.0 if self.over_budget() else 0.0
        flag = torch.tensor([local], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        reason = int(flag.item())
        if reason == 2:
            return self.signal_name or "a stop signal on another rank"
        if reason == 1:
            return "time budget (train.max_time_per_run)"
        return None
