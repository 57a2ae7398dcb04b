"""A recipe file made ready to submit: YAML recipes are rendered, .sub scripts checked as they are.

A hand-written .sub never pays for Jinja2 or YAML: those load only for a YAML recipe.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.errors import UsageError
from orchestrator.resources import locate_recipe
from orchestrator.slurm.directives import parse_sbatch_directives
from orchestrator.slurm.resources import JobResources

if TYPE_CHECKING:
    from orchestrator.recipe import Recipe

YAML_SUFFIXES = (".yaml", ".yml")
SCRIPT_SUFFIXES = (".sub", ".sh")

# $1, ${1}, ${1:?...}: the script reads its first argument, the seed ($10 is ${1}0 to bash).
_READS_FIRST_ARGUMENT = re.compile(r"\$(1|\{1\b)")


@dataclass(frozen=True)
class PreparedScript:
    """A recipe made ready to submit: the script and what its jobs ask for, typed once (from the
    YAML recipe's settings, or from the .sub's ``#SBATCH`` lines)."""

    text: str
    resources: JobResources
    source_kind: str  # "yaml" (rendered) or "sub" (read as it is)
    spec: Recipe | None = None  # the validated recipe, for YAML recipes

    @property
    def programs(self) -> tuple[str, ...]:
        """What its jobs start by name from the PATH (``Recipe.programs``; a .sub's: unknown)."""
        return () if self.spec is None else self.spec.programs()


def read_recipe(given: str) -> tuple[Path, PreparedScript]:
    """The recipe a user names (a path, or the name of a shipped one), checked and prepared."""
    recipe = locate_recipe(given)
    if not recipe.exists():
        raise UsageError(f"recipe {given} does not exist")
    if not recipe.is_file():
        raise UsageError(f"recipe {given} is not a file")
    return recipe, prepare_script(recipe)


def prepare_script(path: Path | str) -> PreparedScript:
    """The script to submit for a recipe: rendered for .yaml/.yml, checked and read for .sub/.sh."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in YAML_SUFFIXES:
        from orchestrator.recipe import load_recipe
        from orchestrator.render import render_recipe

        spec = load_recipe(path)
        text = render_recipe(spec)
        return PreparedScript(text, JobResources.from_settings(spec), "yaml", spec)
    if suffix in SCRIPT_SUFFIXES:
        text = _read_script(path)
        check_seed_contract(text, path)
        directives = parse_sbatch_directives(text)
        if "array" in directives:
            raise UsageError(
                f"recipe {path} sets '#SBATCH --array': a chained job is one job; remove it "
                "(run replicas with auto_launch --members M, each a chain of its own)"
            )
        resources = JobResources.from_directives(directives)
        return PreparedScript(text, resources, "sub")
    accepted = ", ".join(YAML_SUFFIXES + SCRIPT_SUFFIXES)
    raise UsageError(f"recipe {path}: unknown kind {suffix or '(no extension)'}; use {accepted}")


def check_seed_contract(text: str, path: Path) -> None:
    """A .sub must be a script (``#!``) that reads the job's seed from its first argument."""
    if not text.startswith("#!"):
        raise UsageError(
            f"recipe {path}: the first line must be a #! line such as #!/bin/bash (sbatch needs it)"
        )
    code = (line for line in text.splitlines() if not line.lstrip().startswith("#"))
    if not any(_READS_FIRST_ARGUMENT.search(line) for line in code):
        raise UsageError(
            f"recipe {path}: never reads $1; a .sub receives the job's seed as its first "
            "argument (SEED=$1) and must use it"
        )


def _read_script(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as error:
        raise UsageError(f"recipe {path}: cannot read it ({error.strerror})") from error
    except UnicodeDecodeError as error:
        raise UsageError(f"recipe {path}: not a text file ({error.reason})") from error
