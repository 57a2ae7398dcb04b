"""``orchestrator dashboard``: the W&B workspace of ``recipes/wandb/dashboard.yaml``, saved online.

The spec is plain YAML (sections of line plots over step, runs grouped by run group), so it can
also be built by hand in the W&B app; this module turns it into a ``wandb_workspaces`` Workspace.
Only ``save_workspace`` talks to W&B's servers; ``build_workspace`` is offline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from orchestrator.errors import UsageError
from orchestrator.resources import dashboard_spec

SPEC_KEYS = {"name", "x_axis", "group_by", "sections"}


def load_spec(path: Path | None = None) -> dict[str, Any]:
    """Read and check a dashboard spec: every section named, every panel with a title and y keys."""
    path = Path(path or dashboard_spec())
    if not path.is_file():
        raise UsageError(f"dashboard spec {path} does not exist; pass one with --spec")
    spec = yaml.safe_load(path.read_text())
    if not isinstance(spec, dict) or not isinstance(spec.get("sections"), list):
        raise UsageError(f"dashboard spec {path}: needs a 'sections' list")
    unknown = set(spec) - SPEC_KEYS
    if unknown:
        raise UsageError(f"dashboard spec {path}: unknown keys {sorted(unknown)}; use {SPEC_KEYS}")
    for section in spec["sections"]:
        if not isinstance(section, dict) or not section.get("name"):
            raise UsageError(f"dashboard spec {path}: every section needs a name")
        for panel in section.get("panels", []):
            if not isinstance(panel, dict) or not panel.get("title") or not panel.get("y"):
                raise UsageError(
                    f"dashboard spec {path}, section {section['name']!r}: every panel needs a "
                    "title and a y list"
                )
    return spec


def _workspaces() -> tuple[Any, Any, Any]:
    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
        from wandb_workspaces import expr
    except ImportError as error:
        raise UsageError(
            f"orchestrator dashboard needs wandb-workspaces ({error}); "
            "install it with `pip install -e '.[dashboard]'`"
        ) from error
    return ws, wr, expr


def build_workspace(
    spec: dict[str, Any], *, entity: str, project: str, name: str | None = None
) -> Any:
    """The spec as a ``wandb_workspaces.workspaces.Workspace`` (nothing is sent anywhere)."""
    ws, wr, expr = _workspaces()
    x_axis = spec.get("x_axis", "Step")
    sections = [
        ws.Section(
            name=section["name"],
            is_open=True,
            panels=[
                wr.LinePlot(title=panel["title"], x=x_axis, y=list(panel["y"]))
                for panel in section.get("panels", [])
            ],
        )
        for section in spec["sections"]
    ]
    group_by = [expr.Metric(spec["group_by"])] if spec.get("group_by") else []
    return ws.Workspace(
        entity=entity,
        project=project,
        name=name or spec.get("name", "speechlm chains"),
        sections=sections,
        settings=ws.WorkspaceSettings(x_axis=x_axis),
        runset_settings=ws.RunsetSettings(groupby=group_by),
    )


def save_workspace(
    spec: dict[str, Any], *, entity: str, project: str, name: str | None = None
) -> str:
    """Create the workspace on W&B (the API key comes from WANDB_API_KEY or `wandb login`);
    return its URL."""
    workspace = build_workspace(spec, entity=entity, project=project, name=name)
    try:
        return workspace.save().url
    except Exception as error:  # network, auth or permission: wandb raises many kinds
        raise UsageError(
            f"W&B did not save the workspace ({type(error).__name__}: {error}); check "
            "WANDB_API_KEY (or `wandb login`), --entity and --project"
        ) from error
