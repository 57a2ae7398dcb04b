"""The one retry helper: what is retried, how often, with which backoff."""

from __future__ import annotations

import pytest

from orchestrator.errors import SchedulerError, SchedulerTimeout
from orchestrator.retry import REJECTED_MARKERS, TRANSIENT_MARKERS, with_retries


class Scripted:
    """A call that raises the given errors in turn, then returns "ok"."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


def run(call: Scripted, **kwargs) -> tuple[str, list[float]]:
    delays: list[float] = []
    kwargs.setdefault("transient_markers", TRANSIENT_MARKERS)
    kwargs.setdefault("idempotent", True)
    return with_retries(call, sleep=delays.append, **kwargs), delays


def test_transient_errors_are_retried_with_doubling_backoff() -> None:
    busy = SchedulerError("squeue failed: Unable to contact slurm controller (connect failure)")
    call = Scripted(busy, busy, busy)
    result, delays = run(call, first_delay_s=0.5)
    assert result == "ok"
    assert call.calls == 4
    assert delays == [0.5, 1.0, 2.0]


def test_gives_up_after_the_attempts_with_the_last_error() -> None:
    call = Scripted(*(SchedulerError(f"x failed: Connection refused #{i}") for i in range(3)))
    with pytest.raises(SchedulerError, match="#2"):
        run(call, attempts=3)
    assert call.calls == 3


def test_a_permanent_error_is_not_retried() -> None:
    call = Scripted(SchedulerError("sbatch failed: Invalid account or account/partition"))
    with pytest.raises(SchedulerError, match="Invalid account"):
        run(call)
    assert call.calls == 1


def test_a_timeout_is_retried_only_for_an_idempotent_call() -> None:
    idempotent = Scripted(SchedulerTimeout("squeue failed: it did not answer within 30 s"))
    assert run(idempotent)[0] == "ok"
    assert idempotent.calls == 2

    submission = Scripted(SchedulerTimeout("sbatch failed: it did not answer within 60 s"))
    with pytest.raises(SchedulerTimeout):
        run(submission, idempotent=False, transient_markers=REJECTED_MARKERS)
    assert submission.calls == 1


def test_a_non_idempotent_call_retries_errors_that_prove_it_was_refused() -> None:
    refused = SchedulerError("sbatch failed: Slurm temporarily unable to accept job, sleeping")
    ambiguous = SchedulerError("sbatch failed: Socket timed out on send/recv operation")
    call = Scripted(refused)
    assert run(call, idempotent=False, transient_markers=REJECTED_MARKERS)[0] == "ok"
    call = Scripted(ambiguous)
    with pytest.raises(SchedulerError, match="Socket timed out"):
        run(call, idempotent=False, transient_markers=REJECTED_MARKERS)
    assert call.calls == 1
