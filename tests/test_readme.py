"""README's commands, and the command-line reference's (docs/cli.md), name what exists: a
newcomer copies them as they stand.

Which real slips these catch: a recipe renamed or never shipped that README still launches, a
flag removed from ``auto_launch`` that docs/cli.md's option table still offers (or a flag added
that it does not), a make target or a trainer key README uses that is gone (``train.max_step``),
an ``orchestrator`` subcommand or flag renamed.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Iterator

import pytest
from hydra.core.config_store import ConfigStore

import hydra_plugins.orch_chain_launcher.config  # noqa: F401  (registers the chain launchers)
from orchestrator.cli.launch_arguments import auto_launch_parser, split_script_args
from orchestrator.cli.main import orchestrator_parser
from orchestrator.planner.plan_check import compose_training_config, train_arguments
from orchestrator.recipe import load_recipe
from tests.harness.process import REPO
from tests.harness.readme import (
    commands,
    make_targets,
    section,
    table_commands,
    table_options,
)

README = (REPO / "README.md").read_text()
COMMANDS = commands(README)
CLI_DOC = (REPO / "docs" / "cli.md").read_text()
CLI_COMMANDS = commands(CLI_DOC)
SKIPPED = ("source", "eval", "pip", "hf", "cd", "export")  # the shell's, or other tools'
# auto_launch's long options that its option table need not name: help, and -n's long spelling
# (the table's row is `-n N`).
UNTABLED = {"--help", "--num-jobs"}


def parse(parser, words: list[str], where: str = "README"):
    """argparse's reading of ``words``; its refusal (an unknown flag) as a test failure."""
    try:
        return parser.parse_args(words)
    except SystemExit as error:  # 0: --version, --help
        if error.code:
            pytest.fail(f"{where}: {' '.join(words)} is refused ({error})", pytrace=False)


def launchers() -> set[str]:
    shipped = {path.stem for path in (REPO / "recipes/conf/hydra/launcher").glob("*.yaml")}
    return shipped | {
        name.removesuffix(".yaml") for name in ConfigStore.instance().repo["hydra"]["launcher"]
    }


def check(command: list[str], where: str = "README") -> None:
    tool, rest = command[0], command[1:]
    if tool == "make":
        assert set(rest) <= make_targets(REPO / "Makefile"), command
    elif tool == "auto_launch":
        own, script_args = split_script_args(rest)
        recipe = parse(auto_launch_parser(), own, where).recipe
        where_file = REPO / recipe if "/" in recipe else REPO / "recipes" / recipe  # shipped
        assert where_file.is_file(), f"{where} launches {recipe}, which does not exist"
        if script_args:  # the trainer's overrides after --, added to the recipe's command
            arguments = train_arguments([*load_recipe(where_file).command, *script_args])
            assert arguments is not None, f"{where} passes {script_args} to {recipe}'s command"
            compose_training_config(arguments)
    elif tool == "orchestrator":
        parse(orchestrator_parser(), rest, where)
    elif (arguments := train_arguments(command)) is not None:
        if "-m" in arguments:  # a multirun: its launcher exists
            named = [
                word.split("=", 1)[1] for word in arguments if word.startswith("hydra/launcher=")
            ]
            assert set(named) <= launchers(), command
        else:
            compose_training_config(arguments)  # an unknown key or config name raises
    elif tool == "python" and rest[:1] == ["-m"]:
        assert importlib.util.find_spec(rest[1]) is not None, command
    elif tool == "python":
        assert (REPO / rest[0]).is_file(), command
    else:
        assert tool in SKIPPED, f"{where} runs {tool}: teach this test what it needs"


def auto_launch_flags() -> set[str]:
    return {flag for action in auto_launch_parser()._actions for flag in action.option_strings}


def subcommands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], set[str]]]:
    """Each (sub)command of ``parser`` as its words, with the flags it takes."""
    yield path, {flag for action in parser._actions for flag in action.option_strings}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from subcommands(child, (*path, name))


@pytest.mark.parametrize("command", COMMANDS, ids=[" ".join(c)[:60] for c in COMMANDS])
def test_each_readme_command_names_what_exists(command):
    check(command)


@pytest.mark.parametrize("command", CLI_COMMANDS, ids=[" ".join(c)[:60] for c in CLI_COMMANDS])
def test_each_cli_reference_command_names_what_exists(command):
    check(command, "docs/cli.md")


def test_readme_shows_the_quick_start_and_every_option_it_tables_exists():
    assert ["make", "demo"] in COMMANDS and ["make", "test"] in COMMANDS
    offered = table_options(README)  # README may table none: docs/cli.md has the table
    assert set(offered) <= auto_launch_flags(), set(offered) - auto_launch_flags()


def test_cli_reference_tables_every_auto_launch_option_and_no_other():
    known = auto_launch_flags()
    table = section(CLI_DOC, "## `auto_launch`")
    offered = set(table_options(table))
    assert offered, "docs/cli.md has no auto_launch option table"
    assert offered <= known, f"docs/cli.md tables options auto_launch lacks: {offered - known}"
    missing = {flag for flag in known - UNTABLED if flag.startswith("--")} - offered
    assert not missing and "\n| `-n N` |" in table, f"docs/cli.md does not table {missing or '-n'}"


def test_cli_reference_tables_only_orchestrator_subcommands_and_flags_that_exist():
    known = dict(subcommands(orchestrator_parser()))
    rows = table_commands(CLI_DOC, "orchestrator")
    assert rows, "docs/cli.md has no orchestrator command table"
    for words, flags in rows:
        named = " ".join(["orchestrator", *words])
        assert tuple(words) in known, f"docs/cli.md tables {named}, which does not exist"
        unknown = set(flags) - known[tuple(words)]
        assert not unknown, f"docs/cli.md tables {named} {unknown}, which it does not take"
