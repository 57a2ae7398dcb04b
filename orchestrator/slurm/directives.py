"""Reading the ``#SBATCH`` lines of a batch script, the way sbatch itself reads them."""

from __future__ import annotations

import shlex
import signal

from orchestrator.errors import UsageError

# sbatch's short options that take a value, mapped to their long names.
SHORT_OPTIONS = {
    "-a": "array",
    "-A": "account",
    "-c": "cpus-per-task",
    "-D": "chdir",
    "-e": "error",
    "-G": "gpus",
    "-J": "job-name",
    "-N": "nodes",
    "-n": "ntasks",
    "-o": "output",
    "-p": "partition",
    "-q": "qos",
    "-t": "time",
    "-x": "exclude",
}


def directive_lines(text: str) -> list[str]:
    """The ``#SBATCH`` lines sbatch reads: those before the script's first command."""
    lines = []
    for line in text.splitlines()[1:] if text.startswith("#!") else text.splitlines():
        stripped = line.strip()
        if not stripped or (stripped.startswith("#") and not stripped.startswith("#SBATCH")):
            continue
        if not stripped.startswith("#SBATCH"):
            break
        lines.append(stripped)
    return lines


def parse_sbatch_directives(text: str) -> dict[str, str]:
    """Directives as ``{long-name: value}`` (flags map to ""); a later line wins, as in sbatch.

    sbatch stops reading directives at the first command line, so do we.
    """
    directives: dict[str, str] = {}
    for stripped in directive_lines(text):
        words = shlex.split(stripped[len("#SBATCH") :], comments=True)
        position = 0
        while position < len(words):
            word = words[position]
            position += 1
            if word.startswith("--"):
                name, _, value = word[2:].partition("=")
                directives[name] = value
            elif word[:2] in SHORT_OPTIONS:
                value = word[2:]
                if not value and position < len(words):
                    value = words[position]
                    position += 1
                directives[SHORT_OPTIONS[word[:2]]] = value
    return directives


def parse_signal(spec: str) -> tuple[bool, int, float]:
    """``[B:|R:|RB:]SIG[@seconds]`` -> (batch shell only, signal number, seconds before the limit).

    As in sbatch(1): without ``@`` the signal comes 60 s before the limit.
    """
    flags, colon, rest = spec.partition(":")
    if not colon:
        flags, rest = "", spec
    if flags not in ("", "B", "R", "RB", "BR"):
        raise UsageError(f"--signal={spec}: unknown prefix {flags!r}; use B:, R: or RB:")
    name, _, grace = rest.partition("@")
    name = name.upper().removeprefix("SIG")
    number = int(name) if name.isdigit() else getattr(signal, f"SIG{name}", None)
    if number is None:
        raise UsageError(f"--signal={spec}: unknown signal {name!r}")
    if grace and not grace.isdigit():
        raise UsageError(f"--signal={spec}: the delay after @ must be whole seconds")
    return "B" in flags, int(number), float(grace or 60)
