"""The one retry loop: a scheduler call that failed transiently is tried again, with backoff.

Whether a failure may be retried is decided by the caller's explicit arguments, never by which
tuple of markers it happened to pass: ``transient_markers`` name the errors worth another try,
and ``idempotent`` says whether the call may be repeated after a timeout (a timed-out sbatch may
have queued the job, so a retry could submit it twice).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from orchestrator.errors import SchedulerError, SchedulerTimeout

T = TypeVar("T")

# Errors of a controller that is busy or restarting, for calls that may safely be repeated.
TRANSIENT_MARKERS = (
    "Unable to contact slurm controller",
    "Socket timed out",
    "Zero Bytes were transmitted or received",
    "Slurm temporarily unable to accept job",
    "Resource temporarily unavailable",
    "Connection refused",
)
# The subset that proves a submission was not accepted: the only errors a submission retries.
REJECTED_MARKERS = (
    "Unable to contact slurm controller",
    "Slurm temporarily unable to accept job",
    "Connection refused",
)
ATTEMPTS = 5
FIRST_DELAY_S = 0.5  # then doubled: 0.5, 1, 2, 4 s


def is_transient(message: str, markers: Sequence[str] = TRANSIENT_MARKERS) -> bool:
    return any(marker in message for marker in markers)


def with_retries(
    call: Callable[[], T],
    *,
    transient_markers: Sequence[str],
    idempotent: bool,
    attempts: int = ATTEMPTS,
    first_delay_s: float = FIRST_DELAY_S,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """``call()``, tried up to ``attempts`` times while it raises a retryable SchedulerError.

    A SchedulerTimeout is retried only when ``idempotent``; any other SchedulerError only when its
    message holds one of ``transient_markers``. The last error is raised as it is.
    """
    delay = first_delay_s
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except SchedulerTimeout:
            if not idempotent or attempt == attempts:
                raise
        except SchedulerError as error:
            if not is_transient(str(error), transient_markers) or attempt == attempts:
                raise
        sleep(delay)
        delay *= 2
    raise AssertionError("unreachable: the last attempt returns or raises")
