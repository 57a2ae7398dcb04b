"""Rendering YAML recipes into batch scripts through Jinja2 templates.

Templates live in the repository's ``templates/`` (override with ``ORCH_TEMPLATE_DIR``). They
render with StrictUndefined, so a missing variable is an error rather than an empty string, and
every value goes through a quoting filter: ``q`` for plain values, ``word`` for command words and
env values, which may reference the contract variables (see orchestrator.recipe).
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import jinja2

from orchestrator.errors import UsageError
from orchestrator.recipe import CONTRACT_VARIABLES, Recipe

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


def default_template_dir() -> Path:
    override = os.environ.get("ORCH_TEMPLATE_DIR")
    if override:
        return Path(override)
    return Path(__file__).resolve().parents[1] / "templates"


def template_environment(template_dir: Path) -> jinja2.Environment:
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir)),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    environment.filters["q"] = shell_quote
    environment.filters["word"] = shell_word
    return environment


def render_recipe(spec: Recipe, template_dir: Path | None = None) -> str:
    """The batch script for ``spec``, from ``<template_dir>/<spec.template>.sub.j2``."""
    directory = template_dir or default_template_dir()
    name = f"{spec.template}.sub.j2"
    try:
        template = template_environment(directory).get_template(name)
        return template.render(recipe=spec)
    except jinja2.TemplateNotFound as error:
        raise UsageError(f"template {error.name} not found in {directory}") from error
    except jinja2.TemplateError as error:
        raise UsageError(f"template {directory / name} failed to render: {error}") from error
