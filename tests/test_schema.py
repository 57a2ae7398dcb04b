"""One recipe schema: YAML recipes, the chained Hydra launcher and the templates share it."""

from __future__ import annotations

import dataclasses
import re

import pytest

from hydra_plugins.orch_chain_launcher.config import ChainLauncherConf, ChainSettings
from orchestrator.errors import UsageError
from orchestrator.recipe import Recipe, RecipeSettings, explicit_settings, parse_settings
from orchestrator.resources import packaged_templates

RECIPE_ONLY = {"command"}  # the chained launcher takes each member's own command


def test_every_field_comes_from_the_one_definition() -> None:
    launcher = {item.name for item in dataclasses.fields(ChainLauncherConf)}
    chain_own = {item.name for item in dataclasses.fields(ChainSettings)}
    assert set(Recipe.model_fields) - RECIPE_ONLY == set(RecipeSettings.model_fields)
    assert launcher - chain_own == set(RecipeSettings.model_fields)


def test_the_launcher_has_the_recipe_defaults() -> None:
    launcher = ChainLauncherConf()
    defaults = RecipeSettings()
    for name in RecipeSettings.model_fields:
        value = getattr(defaults, name)
        assert getattr(launcher, name) == value, name


def test_only_changed_launcher_settings_count_as_given() -> None:
    settings = {
        name: value
        for name, value in dataclasses.asdict(ChainLauncherConf()).items()
        if name in RecipeSettings.model_fields
    }
    assert explicit_settings(settings) == {}
    settings.update(nodes=2, template="distributed")
    assert explicit_settings(settings) == {"nodes": 2, "template": "distributed"}


def test_launcher_settings_get_the_recipe_errors() -> None:
    with pytest.raises(UsageError, match=r"^hydra.launcher: nodes: 'two' is not a whole number$"):
        parse_settings({"nodes": "two"}, "hydra.launcher")
    with pytest.raises(UsageError, match=r"^hydra.launcher: nodez: unknown field"):
        parse_settings({"nodez": 2}, "hydra.launcher")


def test_the_templates_read_only_fields_of_the_schema() -> None:
    used = set()
    templates = sorted(packaged_templates().glob("*.j2"))
    assert templates, "no packaged templates found"
    for template in templates:
        used |= set(re.findall(r"recipe\.(\w+)", template.read_text()))
    assert used
    assert used <= set(Recipe.model_fields) | {"container_flags"}, used - set(Recipe.model_fields)


@pytest.mark.parametrize(
    ("fields", "programs"),
    [
        ({"command": ["trainer"]}, ("trainer",)),
        ({"command": ["trainer"], "template": "distributed"}, ("torchrun", "trainer")),
        ({"command": ["trainer"], "template": "distributed", "launcher": "srun"}, ("trainer",)),
        ({"command": ["trainer"], "container": {"image": "nvcr.io/nvidia/pytorch:24.01"}}, ()),
        ({"command": ["trainer"], "env": {"PATH": "/opt/trainer/bin"}}, ()),
        ({"command": ["/opt/trainer/bin/trainer"]}, ()),
        ({"command": ["${ORCH_CODE_DIR}"]}, ()),
    ],
    ids=["name", "torchrun", "srun", "container", "env PATH", "path", "expanded"],
)
def test_a_recipe_names_the_programs_its_jobs_look_up_on_path(fields, programs) -> None:
    """What the launch check looks up: none where the jobs do not search this shell's PATH (a
    container's image, an env that sets PATH) or the word is no name to look up (a path, a
    word the job's shell expands)."""
    assert Recipe(**fields).programs() == programs
