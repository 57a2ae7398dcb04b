"""The two kinds of failure a user sees: bad input (exit 2) and a failing scheduler (exit 1);
and the quiet end when the reader of the output went away."""

# 128 + SIGPIPE: what a shell tool exits with when its reader closed the pipe (``| head``).
EXIT_CLOSED_PIPE = 141


class UsageError(Exception):
    """Bad input caught before anything was submitted; the CLI prints it on one line, exits 2."""

    exit_code = 2


class SchedulerError(Exception):
    """The scheduler (sbatch, squeue, a daemon) failed; the message carries its own words."""

    exit_code = 1


class SchedulerTimeout(SchedulerError):
    """A scheduler command did not answer in time: it may or may not have acted."""
