"""What the two programs share: a command's handler run with bad input, a failing scheduler,
Ctrl-C and a closed pipe each turned into one line and its exit code; progress on stderr."""

from __future__ import annotations

import argparse
import os
import sys

from orchestrator.errors import EXIT_CLOSED_PIPE, EXIT_INTERRUPTED, SchedulerError, UsageError


def run_program(handler, args: argparse.Namespace) -> int:
    try:
        code = _reported(handler, args)
        sys.stdout.flush()  # inside the try: a closed pipe shows here, not at exit
        return code
    except BrokenPipeError:
        # The reader went away (``| head``; with ``2>&1 | head`` also before an error line):
        # end quietly, as shell tools do on SIGPIPE, with stdout and stderr pointed at
        # /dev/null so that the interpreter's last flush cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.dup2(devnull, sys.stderr.fileno())
        return EXIT_CLOSED_PIPE


def _reported(handler, args: argparse.Namespace) -> int:
    """The handler's exit code; bad input, a failing scheduler and Ctrl-C said on stderr."""
    try:
        return handler(args)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return UsageError.exit_code
    except SchedulerError as error:
        print(f"error: {error}", file=sys.stderr)
        return SchedulerError.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
