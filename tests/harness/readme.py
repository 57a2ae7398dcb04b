"""The commands README shows, read out of its ``bash`` blocks, for the test that holds them to
the code: every make target, recipe, flag, subcommand and trainer override they name exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

FENCE = re.compile(r"```bash\n(.*?)```", re.DOTALL)
MAKE_TARGET = re.compile(r"^([A-Za-z][\w-]*):", re.MULTILINE)
# An option table's first cell: | `--flag VALUE` | ...
TABLE_OPTION = re.compile(r"^\| `(--[a-z][\w-]*)", re.MULTILINE)


def commands(markdown: str) -> list[list[str]]:
    """Each command of the markdown's ``bash`` blocks as words: continuation lines joined,
    comments dropped, ``a; b`` split."""
    found: list[list[str]] = []
    for block in FENCE.findall(markdown):
        for line in block.replace("\\\n", " ").splitlines():
            command: list[str] = []
            for word in shlex.split(line, comments=True):
                ends = word.endswith(";")
                if word.removesuffix(";"):
                    command.append(word.removesuffix(";"))
                if ends and command:
                    found.append(command)
                    command = []
            if command:
                found.append(command)
    return found


def make_targets(makefile: Path) -> set[str]:
    return set(MAKE_TARGET.findall(makefile.read_text()))


def table_options(markdown: str) -> list[str]:
    """The flags README's option tables name (their first cells)."""
    return TABLE_OPTION.findall(markdown)


def trainer_arguments(command: list[str]) -> list[str] | None:
    """What follows ``-m train`` in ``python -m train ...`` or ``torchrun ... -m train ...``
    (None for another command)."""
    for index in range(len(command) - 1):
        if command[index] == "-m" and command[index + 1] == "train":
            return command[index + 2 :]
    return None
