"""Where the data the toolkit ships lives: found through the installed packages, never through
the checkout, so a wheel works from any directory.

Jinja2 templates are package data of ``templates``; the Hydra configs, the launcher presets, the
ready-made recipes and the dashboard spec are package data of ``recipes``. A user's own files come
first where the toolkit reads such files: ``ORCH_TEMPLATE_DIR`` for templates, a recipe path that
exists for recipes.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

RECIPES_PACKAGE = "recipes"
TEMPLATES_PACKAGE = "templates"


def packaged_templates() -> Path:
    """The folder of the shipped Jinja2 templates (``distributed.sub.j2``...)."""
    return Path(str(files(TEMPLATES_PACKAGE)))


def packaged_recipes() -> Path:
    """The folder of the shipped recipes (``smoke.yaml``, ``train_tiny_fsdp2.yaml``...)."""
    return Path(str(files(RECIPES_PACKAGE)))


def dashboard_spec() -> Path:
    return packaged_recipes() / "wandb" / "dashboard.yaml"


def locate_recipe(given: str | Path) -> Path:
    """The recipe a user names: the file at that path, else, for a bare file name that is not
    here (``smoke.yaml``), the shipped recipe of that name."""
    path = Path(given).expanduser()
    if path.exists() or path.parent != Path("."):
        return path.resolve()
    shipped = packaged_recipes() / path.name
    return shipped if shipped.is_file() else path.resolve()
