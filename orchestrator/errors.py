"""The two kinds of failure a user sees: bad input (exit 2) and a failing scheduler (exit 1);
and the quiet ends: interrupted, or the reader of the output went away. The codes' one table
for users is in docs/local_and_cluster.md#exit-codes (tests/test_exit_codes.py holds them to it).
"""

from collections.abc import Iterator
from contextlib import contextmanager

# auto_launch of a chain that ran on this machine (the local backend) and failed: its status
# (failed, blocked, diverged, stalled) and why are the last lines printed.
EXIT_CHAIN_FAILED = 3
# 128 + SIGINT: what a shell tool exits with when Ctrl-C stopped it.
EXIT_INTERRUPTED = 130
# 128 + SIGPIPE: what a shell tool exits with when its reader closed the pipe (``| head``).
EXIT_CLOSED_PIPE = 141


class UsageError(Exception):
    """Bad input caught before anything was submitted; the CLI prints it on one line, exits 2."""

    exit_code = 2


@contextmanager
def prefixed(prefix: str | None) -> Iterator[None]:
    """A UsageError raised inside says where it came from, ``PREFIX: error`` (e.g. the option
    that named a recipe); None leaves it as it is."""
    try:
        yield
    except UsageError as error:
        if prefix is None:
            raise
        raise UsageError(f"{prefix}: {error}") from error


class SchedulerError(Exception):
    """The scheduler (sbatch, squeue, a daemon) failed; the message carries its own words."""

    exit_code = 1


class SchedulerTimeout(SchedulerError):
    """A scheduler command did not answer in time: it may or may not have acted."""
