"""The commands README and docs/cli.md show, read out of their ``bash`` blocks and tables, for
the test that holds them to the code: every make target, recipe, flag, subcommand and trainer
override they name exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

FENCE = re.compile(r"```bash\n(.*?)```", re.DOTALL)
MAKE_TARGET = re.compile(r"^([A-Za-z][\w-]*):", re.MULTILINE)
# An option table's first cell: | `--flag VALUE` | ...
TABLE_OPTION = re.compile(r"^\| `(--[a-z][\w-]*)", re.MULTILINE)
# A command table's first cell: | `orchestrator status CHAIN [--json]` | ...
TABLE_COMMAND = r"^\| `{tool} ([^`]*)`"
# A flag anywhere in such a cell: --json, [-o FILE.png]
FLAG = re.compile(r"(?<![\w-])(--?[a-z][\w-]*)")


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


def section(markdown: str, heading: str) -> str:
    """The text under ``heading`` (a whole line, e.g. ``## `auto_launch` ``) up to the next
    heading of its level or above; empty when there is no such heading."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = markdown.splitlines()
    if heading not in lines:
        return ""
    body: list[str] = []
    fenced = False
    for line in lines[lines.index(heading) + 1 :]:
        fenced ^= line.startswith("```")
        if not fenced and re.match(rf"#{{1,{level}}} ", line):
            break
        body.append(line)
    return "\n".join(body)


def table_options(markdown: str) -> list[str]:
    """The flags the markdown's option tables name (their first cells)."""
    return TABLE_OPTION.findall(markdown)


def table_commands(markdown: str, tool: str) -> list[tuple[list[str], list[str]]]:
    """Each row of the markdown's command tables for ``tool`` (first cell ``tool sub ...``): the
    leading words that name a subcommand (``cluster up``), and every flag the cell shows."""
    rows = []
    for cell in re.findall(TABLE_COMMAND.format(tool=re.escape(tool)), markdown, re.MULTILINE):
        words = []
        for word in cell.split():
            if not re.fullmatch(r"[a-z][\w-]*", word):
                break
            words.append(word)
        rows.append((words, FLAG.findall(cell)))
    return rows
