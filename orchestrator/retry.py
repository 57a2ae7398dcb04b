"""The one retry loop: a scheduler call that failed transiently is tried again, with backoff,
for a bounded time (a controller restarting takes up to a minute or two), saying so each time.

Whether a failure may be retried is decided by the caller's explicit arguments, never by which
tuple of markers it happened to pass: ``transient_markers`` name the errors worth another try,
and ``idempotent`` says whether the call may be repeated after a timeout (a timed-out sbatch may
have queued the job, so a retry could submit it twice).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from orchestrator.errors import SchedulerError, SchedulerTimeout, UsageError

T = TypeVar("T")

# Errors of a controller that is busy or restarting, for calls that may safely be repeated.
TRANSIENT_MARKERS = (
    "Unable to contact slurm controller",
    "Socket timed out",
    "Zero Bytes were transmitted or received",
    "Slurm temporarily unable to accept job",
    "Resource temporarily unavailable",
    "Connection refused",
    # A controller that drops the connection while it starts or restarts (seen: sinfo's
    # slurm_load_partitions during `orchestrator cluster up`).
    "Connection reset by peer",
    "Transport endpoint is not connected",
)
# The subset that proves a submission was not accepted: the only errors a submission retries.
# ENOTCONN ("Transport endpoint is not connected") is what SLURM's slurm_send_timeout sets when
# the controller's socket is gone while the request is still being sent, never after its last
# byte: a request the controller did not receive whole (seen: sbatch during a controller
# restart, "Batch job submission failed: Transport endpoint is not connected").
REJECTED_MARKERS = (
    "Unable to contact slurm controller",
    "Slurm temporarily unable to accept job",
    "Connection refused",
    "Transport endpoint is not connected",
)
ATTEMPTS = 5  # for callers that want a few quick tries, not the patience below
FIRST_DELAY_S = 0.5  # then doubled, up to MAX_DELAY_S: 0.5, 1, 2, 4, 8, 10, 10 ... s
MAX_DELAY_S = 10.0
# How long a call waits out a controller that does not answer, by default: longer than
# slurmctld takes to come back from a restart (a crash its supervisor restarts, an upgrade, a
# failover to the backup), so that a chain being submitted or a job's hook rides it out.
PATIENCE_S = 120.0
PATIENCE_ENV = "ORCH_SCHEDULER_PATIENCE_S"  # seconds, to wait longer or shorter than that


def is_transient(message: str, markers: Sequence[str] = TRANSIENT_MARKERS) -> bool:
    return any(marker in message for marker in markers)


def patience_s() -> float:
    """How long a scheduler call waits out transient errors: PATIENCE_ENV, else PATIENCE_S."""
    given = os.environ.get(PATIENCE_ENV)
    if not given:
        return PATIENCE_S
    try:
        return max(0.0, float(given))
    except ValueError:
        raise UsageError(f"{PATIENCE_ENV}={given!r}: give a number of seconds") from None


def with_retries(
    call: Callable[[], T],
    *,
    transient_markers: Sequence[str],
    idempotent: bool,
    attempts: int | None = None,
    first_delay_s: float = FIRST_DELAY_S,
    patience: float | None = None,
    announce: Callable[[str], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """``call()``, tried again while it raises a retryable SchedulerError, with backoff, until
    ``attempts`` tries (when given) or ``patience`` seconds (default ``patience_s()``) have
    gone by; ``announce`` gets one line per retry.

    A SchedulerTimeout is retried only when ``idempotent``; any other SchedulerError only when its
    message holds one of ``transient_markers``. The last error is raised, saying how long it
    was waited out when the patience ran out.
    """
    bound = patience_s() if patience is None else patience
    started, delay, attempt = clock(), first_delay_s, 0
    while True:
        attempt += 1
        try:
            return call()
        except SchedulerTimeout as error:
            if not idempotent:
                raise
            last: SchedulerError = error
        except SchedulerError as error:
            if not is_transient(str(error), transient_markers):
                raise
            last = error
        if attempts is not None and attempt >= attempts:
            raise last
        waited = clock() - started
        if waited + delay > bound:
            raise type(last)(
                f"{last} (still failing after {waited:.0f} s of retries; {PATIENCE_ENV} sets "
                "how long to wait)"
            ) from last
        if announce is not None:
            first_line = str(last).splitlines()[0]
            announce(f"{first_line}; trying again in {delay:g} s ({waited:.0f} of {bound:.0f} s)")
        sleep(delay)
        delay = min(2 * delay, MAX_DELAY_S)
