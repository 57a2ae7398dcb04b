"""The one retry helper: what is retried, how often, with which backoff."""

from __future__ import annotations

import pytest

from orchestrator.errors import SchedulerError, SchedulerTimeout
from orchestrator.retry import (
    MAX_DELAY_S,
    PATIENCE_ENV,
    REJECTED_MARKERS,
    TRANSIENT_MARKERS,
    is_transient,
    patience_s,
    with_retries,
)


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


class Clock:
    """A clock that only the fake sleep moves, with each call costing ``call_s``."""

    def __init__(self, call_s: float = 0.0) -> None:
        self.now = 0.0
        self.call_s = call_s
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    def __call__(self) -> float:
        return self.now


def test_a_controller_down_is_waited_out_for_the_patience_one_line_per_retry() -> None:
    """sbatch against a dead controller (each try ~4 s) is retried with backoff capped at
    MAX_DELAY_S until the patience runs out, then fails saying how long it waited."""
    down = SchedulerError("sbatch failed: Unable to contact slurm controller (connect failure)")

    class Down:
        calls = 0

        def __call__(self) -> str:
            self.calls += 1
            clock.now += 4.0
            raise down

    clock, lines, call = Clock(), [], Down()
    with pytest.raises(SchedulerError, match=r"still failing after \d+ s of retries") as failed:
        with_retries(
            call,
            transient_markers=REJECTED_MARKERS,
            idempotent=False,
            patience=60.0,
            announce=lines.append,
            sleep=clock.sleep,
            clock=clock,
        )
    assert PATIENCE_ENV in str(failed.value) and "Unable to contact" in str(failed.value)
    assert clock.slept[:5] == [0.5, 1.0, 2.0, 4.0, 8.0] and max(clock.slept) == MAX_DELAY_S
    assert clock.now <= 60.0 + 4.0  # never a wait that starts past the patience
    assert len(lines) == len(clock.slept) == call.calls - 1
    assert lines[0].startswith("sbatch failed: Unable to contact slurm controller")
    assert "trying again in 0.5 s (4 of 60 s)" in lines[0]


def test_a_controller_back_within_the_patience_is_one_success() -> None:
    down = SchedulerError("scontrol failed: Unable to contact slurm controller")
    clock = Clock()
    call = Scripted(*[down] * 6)
    result = with_retries(
        call,
        transient_markers=TRANSIENT_MARKERS,
        idempotent=True,
        patience=120.0,
        sleep=clock.sleep,
        clock=clock,
    )
    assert result == "ok" and call.calls == 7


def test_the_patience_comes_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(PATIENCE_ENV, "7.5")
    assert patience_s() == 7.5
    monkeypatch.setenv(PATIENCE_ENV, "soon")
    with pytest.raises(Exception, match=f"{PATIENCE_ENV}='soon': give a number of seconds"):
        patience_s()


def test_a_connection_the_controller_resets_is_transient_for_queries_only() -> None:
    """A controller starting or restarting drops connections (sinfo during `cluster up`): a
    query tries again; a submission does not, since it may have been accepted."""
    message = "sinfo failed: slurm_load_partitions: Connection reset by peer"
    assert is_transient(message)
    assert not is_transient(message, REJECTED_MARKERS)


def test_a_request_the_controller_did_not_receive_whole_is_retried_even_as_a_submission() -> None:
    """SLURM sets ENOTCONN only while a request is still being sent: sbatch's submission was not
    accepted, so it is tried again (a chain submitted through a controller restart)."""
    message = "sbatch: error: Batch job submission failed: Transport endpoint is not connected"
    assert is_transient(message)
    assert is_transient(message, REJECTED_MARKERS)
