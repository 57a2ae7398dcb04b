"""README's commands name what exists: a newcomer copies them as they stand.

Which real slips these catch: a recipe renamed or never shipped that README still launches, a
flag removed from ``auto_launch`` that README's table still offers, a make target or a trainer
key README uses that is gone (``train.max_step``), an ``orchestrator`` subcommand renamed.
"""

from __future__ import annotations

import importlib.util

import pytest
from hydra.core.config_store import ConfigStore

import hydra_plugins.orch_chain_launcher.config  # noqa: F401  (registers the chain launchers)
from orchestrator.cli import auto_launch_parser, orchestrator_parser, split_script_args
from orchestrator.planner.preflight import compose_training_config
from tests.harness.process import REPO
from tests.harness.readme import commands, make_targets, table_options, trainer_arguments

README = (REPO / "README.md").read_text()
COMMANDS = commands(README)
SKIPPED = ("source", "eval", "pip", "hf", "cd", "export")  # the shell's, or other tools'


def parse(parser, words: list[str]):
    """argparse's reading of ``words``; its refusal (an unknown flag) as a test failure."""
    try:
        return parser.parse_args(words)
    except SystemExit as error:  # 0: --version, --help
        if error.code:
            pytest.fail(f"README: {' '.join(words)} is refused ({error})", pytrace=False)


def launchers() -> set[str]:
    shipped = {path.stem for path in (REPO / "recipes/conf/hydra/launcher").glob("*.yaml")}
    return shipped | {
        name.removesuffix(".yaml") for name in ConfigStore.instance().repo["hydra"]["launcher"]
    }


def check(command: list[str]) -> None:
    tool, rest = command[0], command[1:]
    if tool == "make":
        assert set(rest) <= make_targets(REPO / "Makefile"), command
    elif tool == "auto_launch":
        own, _ = split_script_args(rest)
        recipe = parse(auto_launch_parser(), own).recipe
        where = REPO / recipe if "/" in recipe else REPO / "recipes" / recipe  # shipped by name
        assert where.is_file(), f"README launches {recipe}, which does not exist"
    elif tool == "orchestrator":
        parse(orchestrator_parser(), rest)
    elif (arguments := trainer_arguments(command)) is not None:
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
        assert tool in SKIPPED, f"README runs {tool}: teach this test what it needs"


@pytest.mark.parametrize("command", COMMANDS, ids=[" ".join(c)[:60] for c in COMMANDS])
def test_each_readme_command_names_what_exists(command):
    check(command)


def test_readme_shows_the_quick_start_and_every_option_it_tables_exists():
    assert ["make", "demo"] in COMMANDS and ["make", "test"] in COMMANDS
    known = {flag for action in auto_launch_parser()._actions for flag in action.option_strings}
    offered = table_options(README)
    assert offered and set(offered) <= known, set(offered) - known
