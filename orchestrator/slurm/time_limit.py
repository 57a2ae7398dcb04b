"""SLURM's time-limit format, as sbatch --time reads it."""

from __future__ import annotations

import re

from orchestrator.errors import UsageError

_DAYS = re.compile(r"^(\d+)-(\d+)(?::(\d+))?(?::(\d+))?$")
_CLOCK = re.compile(r"^(\d+)(?::(\d+))?(?::(\d+))?$")


def parse_time_minutes(text: str) -> float | None:
    """Minutes in a SLURM time string; None for UNLIMITED/INFINITE. Raises UsageError if malformed.

    Accepted, as in sbatch(1): M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
    """
    value = text.strip()
    if value.upper() in ("UNLIMITED", "INFINITE"):
        return None
    if match := _DAYS.match(value):
        days, hours, minutes, seconds = (int(part or 0) for part in match.groups())
        return days * 1440 + hours * 60 + minutes + seconds / 60
    if match := _CLOCK.match(value):
        parts = [int(part) for part in match.groups() if part is not None]
        if len(parts) == 1:
            return float(parts[0])
        if len(parts) == 2:
            return parts[0] + parts[1] / 60
        return parts[0] * 60 + parts[1] + parts[2] / 60
    raise UsageError(
        f"time limit {text!r} is not a SLURM time: use M, M:S, H:M:S, D-H, D-H:M or D-H:M:S"
    )


def format_elapsed(seconds: float) -> str:
    """``seconds`` as SLURM prints a job's elapsed time: [D-]HH:MM:SS."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    clock = f"{hours:02d}:{minutes:02d}:{secs:02d}"
    return f"{days}-{clock}" if days else clock
