"""Rendering YAML recipes into batch scripts through Jinja2 templates.

Templates are package data (the top-level ``templates`` package); a folder in
``ORCH_TEMPLATE_DIR`` comes first, for a user's own templates or their versions of the shipped
ones. They render with
StrictUndefined, so a missing variable is an error rather than an empty string, and
every value goes through a quoting filter: ``q`` for plain values, ``word`` for command words and
env values, which may reference the contract variables (see orchestrator.recipe).
"""

from __future__ import annotations

import functools
import os
import re
import shlex

import jinja2

from contract.job_end import EXIT_CHAIN_ENDED, EXIT_RESTART_IN_JOB, EXITED_PREFIX, RESTART_FLAG
from contract.job_env import IN_JOB_RESTART, PORT_BASE, PORT_SPAN, SPARE_NODES, STOP_AT
from contract.run_dir import AVOID_NODES_DIR
from orchestrator.errors import UsageError
from orchestrator.recipe import CONTRACT_VARIABLES, Recipe
from orchestrator.resources import packaged_templates

_CONTRACT_REFERENCE = re.compile(r"\$\{(" + "|".join(CONTRACT_VARIABLES) + r")\}")


def shell_quote(value: object) -> str:
    return shlex.quote(str(value))


def shell_word(word: str) -> str:
    """One shell word: literal text single-quoted, ``${CONTRACT_VARIABLE}`` as ``"${NAME}"``.

    ``seed=${SEED}`` becomes ``seed="${SEED}"``: one word that expands only the seed.
    """
    parts = []
    position = 0
    for match in _CONTRACT_REFERENCE.finditer(word):
        if match.start() > position:
            parts.append(shlex.quote(word[position : match.start()]))
        parts.append(f'"${{{match.group(1)}}}"')
        position = match.end()
    if position < len(word) or not parts:
        parts.append(shlex.quote(word[position:]))
    return "".join(parts)


TEMPLATE_DIR_ENV = "ORCH_TEMPLATE_DIR"
# Seconds after the launch before the batch shell passes a stop (USR1) on: long enough for srun
# to start the step's tasks and for each task to install its trap.
LAUNCH_SETTLE_S = 5
# The facts of contract/ that the templates write into every script.
CONTRACT = {
    "port_base": PORT_BASE,
    "port_span": PORT_SPAN,
    "exit_chain_ended": EXIT_CHAIN_ENDED,
    "exit_restart_in_job": EXIT_RESTART_IN_JOB,
    "in_job_restart_env": IN_JOB_RESTART,
    "restart_flag": RESTART_FLAG,
    "exited_prefix": EXITED_PREFIX,
    "stop_at_env": STOP_AT,
    "spare_nodes_env": SPARE_NODES,
    "avoid_nodes_dir": AVOID_NODES_DIR,
    "launch_settle_s": LAUNCH_SETTLE_S,
}


def template_environment() -> jinja2.Environment:
    """Templates from ``$ORCH_TEMPLATE_DIR`` first (a user's own, or their versions of the
    shipped ones), then the ones packaged with the orchestrator: one environment per template
    directory, which compiles each template once (a sweep renders one per member) and
    compiles it again when its file changes (Jinja2's loaders check the file's mtime)."""
    return environment_for(os.environ.get(TEMPLATE_DIR_ENV) or None)


@functools.cache
def environment_for(template_dir: str | None) -> jinja2.Environment:
    loaders: list[jinja2.BaseLoader] = []
    if template_dir:
        loaders.append(jinja2.FileSystemLoader(template_dir))
    loaders.append(jinja2.FileSystemLoader(packaged_templates()))
    environment = jinja2.Environment(
        loader=jinja2.ChoiceLoader(loaders),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    environment.filters["q"] = shell_quote
    environment.filters["word"] = shell_word
    return environment


def render_recipe(spec: Recipe) -> str:
    """The batch script for ``spec``, from the template ``<spec.template>.sub.j2``."""
    name = f"{spec.template}.sub.j2"
    where = f"${TEMPLATE_DIR_ENV} or the orchestrator package"
    try:
        template = template_environment().get_template(name)
        return template.render(recipe=spec, **CONTRACT)
    except jinja2.TemplateNotFound as error:
        raise UsageError(f"template {error.name} not found in {where}") from error
    except jinja2.TemplateError as error:
        raise UsageError(f"template {name} failed to render: {error}") from error
